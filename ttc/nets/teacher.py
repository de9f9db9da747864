"""An LM teacher for text models: a DSPy program labels unlabeled texts for a small ONNX student.

    python pipeline.py --model_type text_classifier --dataset_path sms.tsv \\
        --teacher_lm openai/llama3 --teacher_api_base http://localhost:8000/v1 \\
        --unlabeled_path new_texts.txt --output_model runs/sms/model.onnx

The teacher is `dspy.Predict` (or `dspy.ChainOfThought`) over `text -> label` with the dataset's
class names. BootstrapFewShot compiles it on the labelled training split (few-shot demos the
teacher got right), then it labels a sample of the validation split (its accuracy) and the
unlabeled texts. Answers outside the class set are dropped and counted; a failing endpoint stops
the run with exit 5. Calls go through dspy.LM: cached on disk, retried with backoff, each bounded
by a timeout, a fixed number in flight.
"""
from __future__ import annotations

import contextlib
import io
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no cost-map download on import

import dspy  # noqa: E402
import numpy as np  # noqa: E402
from dspy.utils.exceptions import AdapterParseError, LMError  # noqa: E402

from ttc.inputs.data import Dataset, Split  # noqa: E402
from ttc.inputs.preprocess import HF_TOKENIZER, HFTokenizer, Tokenizer, text_tokenizer  # noqa: E402
from ttc.inputs.tables import (TEXT_NAMES, find_by_name, joined_texts, longest_text_column,  # noqa: E402
                    read_table, refuse_nested, resolve_all, split_spec)
from utils import (LOG, ConfigError, DataError, RuntimeFailure, first_line,  # noqa: E402
                   progress, stdout_to_stderr)

if TYPE_CHECKING:
    from ttc.options.stages import TrainingOptions

MAX_BOOTSTRAP_ERRORS = 5
ENDPOINT_HINT = ("check --teacher_lm and --teacher_api_base, that the server is up, and the "
                 "provider's API key variable (e.g. OPENAI_API_KEY)")


# ----------------------------------------------------------------------------- the DSPy program


def class_signature(labels: Sequence[str]) -> type[dspy.Signature]:
    """text -> label, the label one of the dataset's class names."""
    names = ", ".join(labels)
    return dspy.Signature(
        {"text": (str, dspy.InputField(desc="the text to classify")),
         "label": (str, dspy.OutputField(desc=f"exactly one of: {names}"))},
        f"Classify the text into exactly one of these classes: {names}. "
        "Answer with the class name only.")


def teacher_program(labels: Sequence[str], kind: str) -> dspy.Module:
    signature = class_signature(labels)
    return dspy.ChainOfThought(signature) if kind == "cot" else dspy.Predict(signature)


def match_label(answer: object, labels: Sequence[str]) -> str | None:
    """The class an answer names (case, quotes, surrounding punctuation ignored), else None."""
    text = str(answer or "").strip().strip("\"'`*.:;!").strip().lower()
    by_name = {label.lower(): label for label in labels}
    return by_name.get(text)


def make_lm(options: TrainingOptions) -> dspy.LM:
    kwargs = {"temperature": 0.0, "cache": options.teacher_cache,
              "num_retries": options.teacher_retries, "timeout": options.teacher_timeout}
    if options.teacher_api_base:
        kwargs["api_base"] = options.teacher_api_base
    try:
        return dspy.LM(options.teacher_lm, **kwargs)
    except (ValueError, TypeError, LMError) as err:
        raise ConfigError(f"--teacher_lm {options.teacher_lm!r} is not usable: {err}",
                          "give a model string dspy.LM accepts, e.g. openai/gpt-4o-mini") from None


# ----------------------------------------------------------------------------- labelling


@dataclass
class TeacherAnswers:
    """The teacher's answers for a list of texts: a class name, or None when it answered
    something else (outside the class set, or unparseable)."""

    labels: list[str | None]
    outside_classes: int = 0
    unparseable: int = 0

    @property
    def answered(self) -> int:
        return sum(label is not None for label in self.labels)


def ask_teacher(program: dspy.Module, lm: dspy.LM, texts: Sequence[str], classes: Sequence[str],
                threads: int, desc: str, show_progress: bool = True) -> TeacherAnswers:
    """Label `texts` with at most `threads` calls in flight. An endpoint failure (after dspy.LM's
    retries) cancels what is queued and raises RuntimeFailure (exit 5)."""
    labels: list[str | None] = [None] * len(texts)
    result = TeacherAnswers(labels)

    def one(text: str) -> object:
        with dspy.context(lm=lm, disable_history=True):  # history would keep every prompt
            return program(text=text).label

    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = {pool.submit(one, text): i for i, text in enumerate(texts)}
        try:
            for future in progress(as_completed(futures), total=len(futures), desc=desc,
                                   enabled=show_progress):
                i = futures[future]
                try:
                    answer = future.result()
                except AdapterParseError:
                    result.unparseable += 1
                    continue
                labels[i] = match_label(answer, classes)
                result.outside_classes += labels[i] is None
        except LMError as err:
            pool.shutdown(wait=False, cancel_futures=True)
            raise endpoint_failure(lm, err) from None
    return result


def endpoint_failure(lm: dspy.LM, err: BaseException) -> RuntimeFailure:
    first = first_line(err)
    return RuntimeFailure(f"the teacher LM {lm.model} failed: {first[:300]}", ENDPOINT_HINT)


def compile_teacher(program: dspy.Module, lm: dspy.LM, train: Split, labels: Sequence[str],
                    demos: int, seed: int, show_progress: bool = True) -> dspy.Module:
    """BootstrapFewShot on the labelled training split: up to `demos` examples the teacher
    itself labelled right become its prompt's demonstrations (labelled ones fill the rest)."""
    if demos == 0:
        return program
    order = random.Random(seed).sample(range(len(train)), min(len(train), 20 * demos))
    trainset = [dspy.Example(text=train.raw[i], label=labels[train.y[i]]).with_inputs("text")
                for i in order]

    def correct(example, prediction, trace=None) -> bool:
        return match_label(prediction.label, labels) == example.label

    # BootstrapFewShot retries nothing itself and counts every failed example; a few failures
    # mean a dying endpoint, and waiting out timeouts on 20 × demos examples would look hung.
    optimizer = dspy.BootstrapFewShot(metric=correct, max_bootstrapped_demos=demos,
                                      max_labeled_demos=demos, max_errors=MAX_BOOTSTRAP_ERRORS)
    # It prints a line on stdout and draws its own progress bar on stderr.
    bar = (contextlib.nullcontext() if show_progress and sys.stderr.isatty()
           else contextlib.redirect_stderr(io.StringIO()))
    try:
        with dspy.context(lm=lm, disable_history=True), stdout_to_stderr(), bar:
            return optimizer.compile(program, trainset=trainset)
    except LMError as err:
        raise endpoint_failure(lm, err) from None
    except AdapterParseError:
        raise RuntimeFailure(f"the teacher LM {lm.model} gave {MAX_BOOTSTRAP_ERRORS} answers "
                             "DSPy could not parse while compiling its prompt",
                             "try --teacher_program predict, or a stronger model") from None


# ----------------------------------------------------------------------------- unlabeled data


def read_unlabeled(path: str, text_column: str | None) -> list[str]:
    """Texts to label: a .txt file has one per line; a table has the text column(s)."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"--unlabeled_path {path} does not exist", "check the path")
    if file.suffix.lower() == ".txt":
        try:
            lines = file.read_text(encoding="utf-8-sig").splitlines()
        except UnicodeDecodeError:
            raise DataError(f"{path} is not UTF-8 text", "re-save it as UTF-8") from None
        texts = [line.strip() for line in lines]
    else:
        frame = read_table(file, None, "auto", split_spec(text_column))
        columns = (resolve_all(frame, text_column, "text", file)
                   or [find_by_name(frame, TEXT_NAMES) or longest_text_column(frame)])
        refuse_nested(frame, columns, file)
        texts = list(joined_texts(frame, columns))
    texts = [t for t in texts if t]
    if not texts:
        raise DataError(f"--unlabeled_path {path} has no texts", "add one text per line")
    return texts


def new_texts(texts: Sequence[str], dataset: Dataset) -> tuple[list[str], int]:
    """Unique texts not already in the dataset: a validation or test text labelled by the teacher
    and trained on would leak into the scores. Returns the texts and how many were skipped."""
    known = {t for split in dataset.splits.values() for t in (split.raw or [])}
    kept = [t for t in dict.fromkeys(texts) if t not in known]
    return kept, len(texts) - len(kept)


def with_teacher_labels(dataset: Dataset, texts: Sequence[str], labels: Sequence[str],
                        max_vocab: int, max_length: int) -> Dataset:
    """The dataset with the teacher-labelled texts added to its training split; our vocabulary
    is refitted on all training texts (the new words are half of what the teacher brings), a
    Hugging Face tokenizer is kept as it is."""
    index = {label: i for i, label in enumerate(dataset.labels)}
    train = dataset.train
    raw = list(train.raw) + list(texts)
    if dataset.preprocessing.get("tokenizer") == HF_TOKENIZER:
        tokenizer = text_tokenizer(dataset.preprocessing)
    else:
        tokenizer = Tokenizer.fit(raw, max_vocab, max_length)
    y = np.concatenate([train.y, np.array([index[label] for label in labels], dtype=np.int64)])
    ids = list(train.ids) + [f"teacher:{i}" for i in range(len(texts))]
    splits = {"train": Split(tokenizer.encode_batch(raw), y, ids, raw)}
    for name, split in dataset.splits.items():
        if name != "train":
            splits[name] = Split(tokenizer.encode_batch(list(split.raw)), split.y, split.ids,
                                 split.raw)
    preprocessing = (dataset.preprocessing if isinstance(tokenizer, HFTokenizer)
                     else tokenizer.to_manifest())
    return replace(dataset, preprocessing=preprocessing, splits=splits,
                   counts={**dataset.counts, "train": len(y)})


# ----------------------------------------------------------------------------- the stage


@dataclass
class Distillation:
    """The teacher's work: the enlarged dataset and the figures for the report."""

    dataset: Dataset
    section: dict = field(default_factory=dict)


def distill(options: TrainingOptions, dataset: Dataset, lm: dspy.LM | None = None) -> Distillation:
    """Compile the teacher, measure it on validation texts, label the unlabeled texts, and
    return the dataset the student trains on."""
    started = time.perf_counter()
    texts, skipped = new_texts(read_unlabeled(options.unlabeled_path, options.text_column), dataset)
    if skipped:
        LOG.info("skipped %d unlabeled texts already in the dataset or repeated", skipped)
    lm = lm or make_lm(options)
    show = not options.no_progress
    program = teacher_program(dataset.labels, options.teacher_program)
    # One call first: a dead endpoint fails here, before BootstrapFewShot retries it per example.
    ask_teacher(program, lm, dataset.train.raw[:1], dataset.labels, 1, "probe", False)
    LOG.info("teacher %s answers; compiling it with BootstrapFewShot (%d demos)", lm.model,
             options.teacher_demos)
    program = compile_teacher(program, lm, dataset.train, dataset.labels, options.teacher_demos,
                              options.seed, show)
    limit = options.teacher_val_limit or len(dataset.val)
    val_texts, val_y = dataset.val.raw[:limit], dataset.val.y[:limit]
    on_val = ask_teacher(program, lm, val_texts, dataset.labels, options.teacher_threads,
                         "teacher on val", show)
    truth = [dataset.labels[y] for y in val_y]
    val_accuracy = (sum(a == t for a, t in zip(on_val.labels, truth)) / len(truth)
                    if truth else None)
    answers = ask_teacher(program, lm, texts, dataset.labels, options.teacher_threads,
                          "teacher labelling", show)
    kept = [(t, label) for t, label in zip(texts, answers.labels) if label is not None]
    if answers.outside_classes or answers.unparseable:
        LOG.warning("dropped %d teacher answers outside the classes (%s) and %d unparseable ones",
                    answers.outside_classes, ", ".join(dataset.labels), answers.unparseable)
    enlarged = with_teacher_labels(dataset, [t for t, _ in kept], [label for _, label in kept],
                                   options.max_vocab, options.max_length) if kept else dataset
    section = {
        "lm": lm.model, "program": options.teacher_program,
        "demos": sum(len(p.demos) for p in program.predictors()),
        "val_accuracy": val_accuracy, "val_samples": len(truth),
        "unlabeled_texts": len(texts) + skipped, "skipped_known_or_repeated": skipped,
        "labelled": len(kept), "dropped_outside_classes": answers.outside_classes,
        "unparseable": answers.unparseable,
        "label_counts": {c: sum(label == c for _, label in kept) for c in dataset.labels},
        "student_train_samples": len(enlarged.train),
        "seconds": round(time.perf_counter() - started, 3),
    }
    LOG.info("teacher: val accuracy %s on %d texts; labelled %d of %d unlabeled texts",
             "n/a" if val_accuracy is None else f"{val_accuracy:.4f}", len(truth), len(kept),
             len(texts))
    return Distillation(enlarged, section)
