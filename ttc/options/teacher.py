"""The LM teacher's flags (text models): the language model that labels --unlabeled_path for
the student, its DSPy program, and how its calls are paced, retried and cached."""
from __future__ import annotations

from dataclasses import dataclass

from ttc.options.fields import bad, opt, parse_bool, positive
from ttc.tasks.registry import find_task
from utils import ConfigError


@dataclass
class TeacherFlags:
    teacher_lm: str | None = opt(None, "text: a language model that labels --unlabeled_path for "
                                 "the student to learn from; any model string dspy.LM accepts, "
                                 "e.g. openai/gpt-4o-mini or, for a local OpenAI-compatible "
                                 "server, openai/MODEL with --teacher_api_base", "teacher",
                                 metavar="MODEL", scripts="PT")
    teacher_api_base: str | None = opt(None, "the teacher's endpoint, e.g. "
                                       "http://localhost:8000/v1 (API keys come from the "
                                       "provider's usual variable, e.g. OPENAI_API_KEY)",
                                       "teacher", metavar="URL", scripts="PT")
    unlabeled_path: str | None = opt(None, "texts for the teacher to label: a .txt file (one "
                                     "text per line) or a CSV/TSV/JSON/JSONL table with the "
                                     "training data's text column(s)", "teacher", metavar="PATH",
                                         scripts="PT")
    teacher_program: str = opt("predict", "the DSPy program over text -> label: predict "
                               "(dspy.Predict) or cot (dspy.ChainOfThought)", "teacher",
                               choices=("predict", "cot"), scripts="PT")
    teacher_demos: int = opt(4, "few-shot demonstrations BootstrapFewShot compiles into the "
                             "teacher's prompt from the labelled training split (0: zero-shot)",
                             "teacher", type=int, metavar="N", scripts="PT")
    teacher_threads: int = opt(4, "teacher calls in flight at once", "teacher", type=int,
                               metavar="N", scripts="PT")
    teacher_timeout: float = opt(60.0, "seconds one teacher call may take before it fails",
                                 "teacher", type=float, metavar="S", scripts="PT")
    teacher_retries: int = opt(3, "retries of a failed teacher call (with backoff) before the "
                               "run stops with exit 5", "teacher", type=int, metavar="N",
                                   scripts="PT")
    teacher_val_limit: int = opt(500, "validation texts the teacher labels to measure its "
                                 "accuracy (0: all)", "teacher", type=int, metavar="N",
                                     scripts="PT")
    teacher_cache: bool = opt(True, "cache teacher answers on disk (DSPy's cache: "
                              "$DSPY_CACHEDIR, else ~/.dspy_cache), so a rerun costs no calls",
                              "teacher", type=parse_bool, metavar="BOOL", scripts="PT")

    def check_teacher(self, model_type: str) -> None:
        """The teacher and its texts go together, label text only, and pace sensibly."""
        if not self.teacher_lm and not self.unlabeled_path:
            return
        if not (self.teacher_lm and self.unlabeled_path):
            raise ConfigError("--teacher_lm and --unlabeled_path go together: the teacher "
                              "labels the unlabeled texts", "give both, or neither")
        task = find_task(model_type)
        if task is None or not task.teacher:
            raise ConfigError(f"--teacher_lm labels texts; this is a {model_type}",
                              "use it with --model_type text_classifier")
        if self.teacher_demos < 0:
            bad("teacher_demos", self.teacher_demos, "use 0 (zero-shot) or a small count like 4")
        if not 1 <= self.teacher_threads <= 64:
            bad("teacher_threads", self.teacher_threads, "use 1 to 64 threads")
        positive("teacher_timeout", self.teacher_timeout)
        if self.teacher_retries < 0:
            bad("teacher_retries", self.teacher_retries, "use 0 or a small count like 3")
        if self.teacher_val_limit < 0:
            bad("teacher_val_limit", self.teacher_val_limit, "use 0 (all) or a count")
