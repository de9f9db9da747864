"""What the bench scripts share: set up quiet logging and one torch thread, train + export a
bundle in-process exactly as pipeline.py does, scratch folders removed at exit, and what --quick
needs (a stand-in for the SMS Spam Collection)."""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from config import Config  # noqa: E402
from ttc.serving.bundle import BundlePaths
from utils import quiet_library_loggers, setup_logging  # noqa: E402


def quiet_single_thread(quick: bool = False) -> None:
    """Quiet logs, one torch thread; under --quick also the tool's timing loops cut short
    (quick_timing)."""
    setup_logging("ERROR")
    import torch

    from ttc.nets import dspy_program  # noqa: F401 - imports dspy, which resets its loggers: quiet them after

    quiet_library_loggers()
    torch.set_num_threads(1)
    if quick:
        quick_timing()


def train_bundle(config: Config):
    """Train and export; returns (dataset, trained model, bundle paths, export result)."""
    from ttc.inputs.data import DataOptions, load_dataset
    from ttc.convert.bundle import export_bundle
    from ttc.nets.training import train_classifier
    from ttc.training.stage import build_manifest

    dataset = load_dataset(DataOptions.from_config(config))
    trained = train_classifier(config, dataset)
    paths = BundlePaths.from_model_path(config.output_model)
    exported = export_bundle(config, trained.net, build_manifest(config, trained, dataset),
                             dataset.test.x, dataset.train.x, paths)
    return dataset, trained, paths, exported


def run_cases(cases, measure, *args) -> None:
    """measure(*case, *args) for each case; a case whose data file is missing is skipped."""
    for case in cases:
        if case[2].endswith(".tsv") and not Path(case[2]).exists():
            print(f"\n{case[0]}: skipped, {case[2]} not found")
            continue
        measure(*case, *args)


QUICK_HELP = ("a smoke run in seconds: tiny data, one round, one epoch, the smallest sizes, "
              "through the same code; its figures mean nothing")


def add_quick_flag(parser: argparse.ArgumentParser) -> None:
    """--quick, and --check_flags: parse the flags (an unknown or malformed one is exit 2, as
    always) and stop there. The docs test runs a script's first documented command with --quick
    and checks the flags of its others this way."""
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)
    parser.add_argument("--check_flags", action="store_true",
                        help="check the flags and exit without running")
    parse = parser.parse_args

    def parse_or_stop(*args, **kwargs):
        parsed = parse(*args, **kwargs)
        if parsed.check_flags:
            raise SystemExit(0)
        return parsed

    parser.parse_args = parse_or_stop


QUICK_TIMED_RUNS = 2  # --quick: timed turns of the tool's own timing loops in this process


def quick_timing() -> None:
    """--quick, in this process only: the tool's timing loops (runtime.time_runners' defaults,
    the benchmark's and the compression judge's turns) at 1 warm-up and QUICK_TIMED_RUNS turns
    with no minimum time, so that a smoke run's time is not timing; the same code runs."""
    from ttc.compress import judging
    from ttc.online import evaluate
    from ttc.serving import runtime

    runtime.MIN_TIMED_RUNS, runtime.WARMUP_RUNS = QUICK_TIMED_RUNS, 1
    runtime.MIN_TIMING_SECONDS = 0.0
    evaluate.BENCHMARK_RUNS = judging.TIMED_RUNS = QUICK_TIMED_RUNS


_SCRATCH: tempfile.TemporaryDirectory | None = None


def scratch_dir() -> Path:
    """A fresh folder under one temporary directory that is removed when the script exits."""
    global _SCRATCH
    if _SCRATCH is None:
        _SCRATCH = tempfile.TemporaryDirectory(prefix="bench_")
    return Path(tempfile.mkdtemp(dir=_SCRATCH.name))


HAM = ["see you at lunch tomorrow", "ok i will call you later", "are we still on for tonight",
       "sorry i am running late again", "thanks for the ride home", "what time is the game",
       "can you pick up some milk", "happy birthday hope you have a great day"]
SPAM = ["WIN a free prize now", "URGENT claim your cash award today", "you have won a guaranteed "
        "prize reply now", "free entry to win a new mobile", "call now to claim your reward",
        "txt WIN to receive your cash offer"]


def write_sms_standin(path: Path, rows: int = 80, seed: int = 0) -> Path:
    """A headerless label<TAB>text TSV shaped like the SMS Spam Collection (about a third spam,
    whose texts carry money words and long numbers): what --quick trains on when no SMS file is
    given. Its figures mean nothing."""
    rng = random.Random(seed)
    lines = []
    for k in range(rows):
        if k % 3 == 0:
            lines.append(f"spam\t{rng.choice(SPAM)} {rng.randint(10_000, 99_999)}")
        else:
            lines.append(f"ham\t{rng.choice(HAM)} {rng.choice(['', 'ok', 'x', ':)'])}".rstrip())
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def sms_or_standin(given: str | Path | None, quick: bool) -> str | None:
    """The SMS TSV to use: the one given, else under --quick a stand-in in a scratch folder,
    else None (the SMS case is skipped)."""
    if given:
        return str(given)
    return str(write_sms_standin(scratch_dir() / "sms_standin.tsv")) if quick else None
