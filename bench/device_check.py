"""The GPU device check (issue 62): the same fixed recipe trained by pipeline.py on the CPU, on
CUDA in float32 and on CUDA in mixed precision, for three networks, and each bundle put through
the same numeric checks; a table of training throughput per (model, device, amp) with the
ratios side by side, and the goals judged.

    python bench/device_check.py [--models digits_cnn,resnet18,centernet] [--threads N]
                                 [--gpu_amp bf16|fp16] [--batch_size N] [--budget_s 420]
                                 [--strict_goals] [--json FILE] [--logs DIR] [--quick]

The models (each `pipeline.py` as a subprocess, its data built into the tool):
  digits_cnn  --dataset_path builtin:digits (the default small_cnn, 8 x 8 pixels, 1,259 training
              images), 5 epochs
  centernet   --model_type object_detector --dataset_path builtin:digit_boxes (the default
              centernet, 600 canvases of 64 px, 420 to train on), 10 epochs
  resnet18    --dataset_path builtin:digits --image_size 32 --arch resnet18 (the digits scaled
              to 32 px: torchvision's ResNet-18 with its stride-1 stem for small images), 3 epochs
Each runs three times, in this order: `--device cuda --amp off` (float32; TF32 where torch
allows it by default), `--device cuda --amp bf16` (--gpu_amp) and `--device cpu --amp off`
(last: the slowest, so that a cut by the budget falls on it). Every run has the same
flags besides: --epochs E --patience 0 (every epoch is trained) --seed 0 --calibrate none
--plots none --no_progress true --num_threads T (T = --threads, default: the CPUs this process
may use, so that the CPU row is the CPU at its best; the GPU rows get the same T for their
host-side work) and --timeout_s (what is left of --budget_s).

Throughput: training samples per second of a steady epoch, train.samples / the median of
train.history[k].seconds over the epochs after the first (the first pays for CUDA's start-up and
cuDNN's autotuning; with one epoch, that one). An epoch is the tool's whole epoch: the training
steps, BatchNorm re-estimation over the training split and the validation pass. The test metric
is the report's evaluation: accuracy (classifiers) or mAP@[.5:.95] (detector), as points.

Checks (a failed one exits 1): the run exits 0 with report status ok; train.device is the device
asked for and train.amp the precision asked for; every epoch ran; export.checker is "passed" and
export.max_abs_diff is within the tool's --validate_atol default for the arch
(ttc.options.export). Goals (judged and printed, exit 1 only with --strict_goals): ResNet-18
CUDA float32 throughput >= 10x the CPU's; the detector's epoch on CUDA float32 >= 10x the CPU's;
each model's CUDA float32 test metric within 0.5 points of the CPU's; mixed precision >= 1.3x
float32 on the GPU for ResNet-18 and the detector, at equal test metric (within 0.5 points).
Each row also shows its metric's difference from the CPU row. Mind the test splits' size: one
digit of 269 is 0.37 points, so the 0.5-point goals ask for at most one image's difference.

Without CUDA the GPU rows are printed as "cuda: not available (torch X, CUDA build Y)" and not
judged (exit 0 when the CPU rows pass). Not measured here at all: ONNX Runtime's CUDA and
TensorRT execution providers (the bundles are checked with the onnxruntime that is installed;
its providers are printed, and the GPU machine has the CPU build). --budget_s bounds the whole
run: a run that would start with less than 20 s of it left is skipped as not measured, and a run
cut by it (not a failed check) keeps the epoch times its log printed. --json writes every figure;
--logs keeps each run's stderr. --quick: digits_cnn for 1 epoch and centernet for 2 (after one
its near-tied scores can fail the detector's own export check) on 1 thread: half a minute on a
CPU, for CI; its figures mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import REPO, add_quick_flag, scratch_dir
from ttc.options.export import VALIDATE_ATOL, VALIDATE_ATOL_FOR_ARCH


@dataclass(frozen=True)
class Model:
    name: str
    flags: tuple[str, ...]
    arch: str
    epochs: int
    metric: str  # the report's evaluation key: accuracy or map
    quick_epochs: int = 1


MODELS = {m.name: m for m in (
    Model("digits_cnn", ("--dataset_path", "builtin:digits"), "small_cnn", 5, "accuracy"),
    Model("centernet", ("--model_type", "object_detector", "--dataset_path",
                        "builtin:digit_boxes"), "centernet", 10, "map", quick_epochs=2),
    Model("resnet18", ("--dataset_path", "builtin:digits", "--image_size", "32", "--arch",
                       "resnet18"), "resnet18", 3, "accuracy"),
)}
QUICK_MODELS = ("digits_cnn", "centernet")  # ResNet-18 takes minutes an epoch on 2 CPU cores
THROUGHPUT_GOAL = {"resnet18": 10.0, "centernet": 10.0}  # CUDA fp32 / CPU
AMP_GOAL = 1.3  # mixed precision / fp32 on the GPU
AMP_GOAL_MODELS = ("resnet18", "centernet")
METRIC_TOLERANCE_PT = 0.5
MIN_RUN_S = 20  # a run is not started with less of the budget left
TRAINING_LINE = re.compile(r"INFO\s+training \S+ \(\d+ parameters\) on (\d+) (?:samples|images)")
EPOCH_LINE = re.compile(r"INFO\s+epoch (\d+)/(\d+) .*\((\d+(?:\.\d+)?)s\)\s*$", re.M)


@dataclass
class Row:
    """One pipeline.py run and what it measured."""

    model: str
    device: str
    amp: str
    epochs: int
    status: str = "not run"  # ok, failed, or not measured (in full): why
    device_reported: str | None = None
    amp_reported: str | None = None
    samples: int | None = None
    epoch_seconds: list[float] = field(default_factory=list)
    samples_per_s: float | None = None
    train_seconds: float | None = None
    wall_seconds: float | None = None
    metric: str = "accuracy"
    test_metric_pt: float | None = None
    val_metric_pt: float | None = None
    checker: str | None = None
    max_abs_diff: float | None = None
    atol: float | None = None
    top1_agreement: float | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str, str]:
        return self.model, self.device, self.amp

    @property
    def measured(self) -> bool:
        return self.samples_per_s is not None


# ----------------------------------------------------------------------------- environment

def cuda_state() -> tuple[bool, str]:
    """(usable, one line): the GPU's name, or why not."""
    import torch

    build = torch.version.cuda or "none"
    if not torch.cuda.is_available():
        return False, f"cuda: not available (torch {torch.__version__}, CUDA build {build})"
    name = torch.cuda.get_device_name(0)
    return True, f"cuda: {name} (torch {torch.__version__}, CUDA build {build}, " \
                 f"{torch.cuda.device_count()} GPU(s))"


def ort_state() -> dict:
    """onnxruntime's version and providers, and what that leaves unmeasured."""
    try:
        import onnxruntime
    except ImportError as error:
        return {"version": None, "providers": [], "note": f"onnxruntime not importable: {error}"}
    providers = onnxruntime.get_available_providers()
    gpu = [p for p in providers if p in ("CUDAExecutionProvider", "TensorrtExecutionProvider")]
    note = ("not measured: ONNX Runtime's CUDA and TensorRT execution providers (this "
            "onnxruntime has neither; the bundles are checked on its CPU provider)") if not gpu \
        else f"available but not measured here: {', '.join(gpu)} (bundles checked as exported)"
    return {"version": onnxruntime.__version__, "providers": providers, "note": note}


def usable_cpus() -> int:
    """The CPUs this process may run on, capped by a cgroup v2 CPU quota where one is set (a
    container may see more CPUs than it may use, and too many threads on too few CPUs is
    many times slower, not a little)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, cgroup_cpus() or cpus))


def cgroup_cpus() -> int | None:
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else max(1, int(int(quota) // int(period)))


# ----------------------------------------------------------------------------- one run

def run_command(model: Model, row: Row, folder: Path, threads: int, batch_size: int | None,
                timeout_s: float) -> list[str]:
    flags = [sys.executable, str(REPO / "pipeline.py"), *model.flags, "--epochs", str(row.epochs),
             "--patience", "0", "--seed", "0", "--calibrate", "none", "--plots", "none",
             "--no_progress", "true", "--num_threads", str(threads), "--device", row.device,
             "--amp", row.amp, "--timeout_s", str(int(timeout_s)),
             "--output_model", str(folder / "model.onnx"),
             "--report_json", str(folder / "report.json")]
    return flags + (["--batch_size", str(batch_size)] if batch_size else [])


def steady_rate(samples: int, seconds: list[float]) -> float | None:
    """Samples per second of the median epoch after the first (the only one if just one)."""
    steady = seconds[1:] or seconds
    return samples / statistics.median(steady) if steady and samples else None


def read_report(row: Row, report: dict, model: Model) -> None:
    """Fill `row` from pipeline.py's report."""
    train, export = report.get("train") or {}, report.get("export") or {}
    evaluation = report.get("evaluation") or {}
    row.device_reported, row.amp_reported = train.get("device"), train.get("amp")
    row.samples, row.train_seconds = train.get("samples"), train.get("seconds")
    row.epoch_seconds = [h["seconds"] for h in train.get("history") or []]
    row.samples_per_s = steady_rate(row.samples or 0, row.epoch_seconds)
    row.test_metric_pt = _points(evaluation.get(model.metric))
    row.val_metric_pt = _points(train.get("val_accuracy"))
    row.checker, row.max_abs_diff = export.get("checker"), export.get("max_abs_diff")
    row.top1_agreement = export.get("top1_agreement")


def _points(value: float | None) -> float | None:
    return None if value is None else round(100.0 * value, 2)


def read_log(row: Row, log: str) -> None:
    """The training split's size and the epoch times pipeline.py logged: what a run cut short
    (no report) still tells."""
    found = TRAINING_LINE.search(log)
    row.samples = row.samples or (int(found.group(1)) if found else None)
    row.epoch_seconds = [float(m.group(3)) for m in EPOCH_LINE.finditer(log)]
    row.samples_per_s = steady_rate(row.samples or 0, row.epoch_seconds)


def check_row(row: Row, code: int) -> None:
    """The hard checks; each failure is one line in row.failures."""
    want_device = "cpu" if row.device == "cpu" else "cuda"
    failures = [
        (code != 0, f"exit {code}"),
        (not (row.device_reported or "").startswith(want_device),
         f"train.device {row.device_reported!r}, not {want_device}"),
        (row.amp_reported != row.amp, f"train.amp {row.amp_reported!r}, not {row.amp!r}"),
        (len(row.epoch_seconds) != row.epochs,
         f"{len(row.epoch_seconds)} of {row.epochs} epochs ran"),
        (row.checker != "passed", f"export.checker {row.checker!r}"),
        (row.max_abs_diff is None or row.max_abs_diff > (row.atol or 0),
         f"export.max_abs_diff {row.max_abs_diff} > {row.atol}"),
    ]
    row.failures = [text for failed, text in failures if failed]


def run_row(model: Model, row: Row, threads: int, batch_size: int | None, timeout_s: float,
            logs: Path | None) -> None:
    folder = scratch_dir()
    row.metric, row.atol = model.metric, VALIDATE_ATOL_FOR_ARCH.get(model.arch, VALIDATE_ATOL)
    command = run_command(model, row, folder, threads, batch_size, timeout_s)
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout_s + 15, stdin=subprocess.DEVNULL)
        code, log = done.returncode, done.stderr
    except subprocess.TimeoutExpired as expired:
        code, log = 124, _text(expired.stderr)
    row.wall_seconds = round(time.perf_counter() - started, 1)
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{row.model}_{row.device}_{row.amp}.log").write_text(log, encoding="utf-8")
    report = folder / "report.json"
    if report.exists():
        read_report(row, json.loads(report.read_text(encoding="utf-8")), model)
    if not row.epoch_seconds:
        read_log(row, log)
    if code == 124:  # cut by --budget_s: measured as far as it went, not a failed check
        row.status = f"not measured in full: cut by the budget after {len(row.epoch_seconds)} " \
                     f"of {row.epochs} epochs"
        return
    row.status = "ok" if code == 0 else "failed"
    check_row(row, code)
    if row.failures and code != 0:
        last = (log.strip().splitlines() or [""])[-1]
        row.failures.append(f"stderr: {last[:400]}")


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


# ----------------------------------------------------------------------------- the plan

def plan(models: list[str], quick: bool, gpu_amp: str) -> list[Row]:
    """Every (model, device, amp) row, in the order they run: per model CUDA fp32, CUDA mixed
    precision, then the CPU (the slowest: a cut by the budget falls on it, and its log still
    tells the epochs it ran)."""
    rows = []
    for name in models:
        epochs = MODELS[name].quick_epochs if quick else MODELS[name].epochs
        rows += [Row(name, "cuda", "off", epochs), Row(name, "cuda", gpu_amp, epochs),
                 Row(name, "cpu", "off", epochs)]
    return rows


def run_all(rows: list[Row], cuda: tuple[bool, str], threads: int, batch_size: int | None,
            budget_s: float, logs: Path | None) -> None:
    deadline = time.monotonic() + budget_s
    for row in rows:
        left = deadline - time.monotonic()
        if row.device != "cpu" and not cuda[0]:
            row.status = f"not measured: {cuda[1]}"
        elif left < MIN_RUN_S:
            row.status = f"not measured: --budget_s {budget_s:g} spent"
        else:
            print(f"  running {row.model} on {row.device} ({row.amp}), {row.epochs} epoch(s), "
                  f"{int(left)} s of the budget left ...", flush=True)
            run_row(MODELS[row.model], row, threads, batch_size, left, logs)


# ----------------------------------------------------------------------------- judging

def find(rows: list[Row], model: str, device: str, amp: str) -> Row | None:
    return next((r for r in rows if r.key == (model, device, amp)), None)


def ratio(top: Row | None, bottom: Row | None) -> float | None:
    if top is None or bottom is None or not (top.measured and bottom.measured):
        return None
    return top.samples_per_s / bottom.samples_per_s


def metric_delta(row: Row | None, base: Row | None) -> float | None:
    if row is None or base is None or None in (row.test_metric_pt, base.test_metric_pt):
        return None
    return round(row.test_metric_pt - base.test_metric_pt, 2)


def goals(rows: list[Row], gpu_amp: str) -> list[dict]:
    """Each goal: what it asks, the figure, and met (None: not measured)."""
    judged = []
    for model, times in THROUGHPUT_GOAL.items():
        value = ratio(find(rows, model, "cuda", "off"), find(rows, model, "cpu", "off"))
        judged.append(_goal(f"{model}: CUDA fp32 / CPU samples/s >= {times:g}x", value,
                            None if value is None else value >= times))
    for model in dict.fromkeys(r.model for r in rows):
        delta = metric_delta(find(rows, model, "cuda", "off"), find(rows, model, "cpu", "off"))
        judged.append(_goal(f"{model}: CUDA fp32 test metric within ±{METRIC_TOLERANCE_PT:g} pt "
                            f"of the CPU's", delta,
                            None if delta is None else abs(delta) <= METRIC_TOLERANCE_PT, "pt"))
    for model in AMP_GOAL_MODELS:
        amp, fp32 = find(rows, model, "cuda", gpu_amp), find(rows, model, "cuda", "off")
        value, delta = ratio(amp, fp32), metric_delta(amp, fp32)
        met = None if value is None or delta is None else \
            value >= AMP_GOAL and abs(delta) <= METRIC_TOLERANCE_PT
        judged.append(_goal(f"{model}: CUDA {gpu_amp} / fp32 samples/s >= {AMP_GOAL:g}x at "
                            f"test metric within ±{METRIC_TOLERANCE_PT:g} pt "
                            f"(difference {_fmt(delta, '+.2f')} pt)", value, met))
    return judged


def _goal(text: str, value: float | None, met: bool | None, unit: str = "x") -> dict:
    return {"goal": text, "value": None if value is None else round(value, 2), "unit": unit,
            "met": met}


# ----------------------------------------------------------------------------- printing

def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


HEADER = (f"{'model':<11} {'device':<6} {'amp':<5} {'ep':>3} {'s/epoch':>8} {'samples/s':>10} "
          f"{'x CPU':>7} {'x fp32':>7} {'test metric':>14} {'vs CPU':>7} {'max|diff|':>9} "
          f"{'checker':<8} status")


def table_line(row: Row, rows: list[Row]) -> str:
    cpu, fp32 = find(rows, row.model, "cpu", "off"), find(rows, row.model, "cuda", "off")
    steady = row.epoch_seconds[1:] or row.epoch_seconds
    metric = "-" if row.test_metric_pt is None else f"{row.metric} {row.test_metric_pt:.2f}"
    x_cpu = ratio(row, cpu) if row.device != "cpu" else None
    x_fp32 = ratio(row, fp32) if row.amp != "off" else None
    status = row.status if not row.failures else f"{row.status}; FAILED: " + "; ".join(row.failures)
    return (f"{row.model:<11} {row.device:<6} {row.amp:<5} {row.epochs:>3} "
            f"{_fmt(statistics.median(steady) if steady else None, '.2f'):>8} "
            f"{_fmt(row.samples_per_s, '.1f'):>10} {_fmt(x_cpu, '.1f'):>7} "
            f"{_fmt(x_fp32, '.2f'):>7} {metric:>14} "
            f"{_fmt(metric_delta(row, cpu) if row.device != 'cpu' else None, '+.2f'):>7} "
            f"{_fmt(row.max_abs_diff, '.1e'):>9} {row.checker or '-':<8} {status}")


def print_results(rows: list[Row], judged: list[dict], header: list[str]) -> None:
    print()
    for line in header:
        print(line)
    print("samples/s: training samples / the median steady epoch (epochs after the first); "
          "x CPU, x fp32: ratios of samples/s; vs CPU: test metric difference in points")
    print(HEADER)
    for row in rows:
        print(table_line(row, rows))
    print("\ngoals:")
    for goal in judged:
        verdict = {True: "met", False: "goal NOT met", None: "not measured"}[goal["met"]]
        spec = "+.2f" if goal["unit"] == "pt" else ".2f"
        print(f"  {goal['goal']}: {_fmt(goal['value'], spec)} {goal['unit']} -> {verdict}")


# ----------------------------------------------------------------------------- main

def model_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in MODELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown) or 'none given'}; use "
                                         f"{', '.join(MODELS)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=model_list, default=None,
                        help=f"comma-separated, of {', '.join(MODELS)} (default: all; "
                             f"--quick: {', '.join(QUICK_MODELS)})")
    parser.add_argument("--threads", type=int, default=0,
                        help="--num_threads of every run (default: the usable CPUs; --quick: 1)")
    parser.add_argument("--gpu_amp", choices=("bf16", "fp16"), default="bf16",
                        help="the mixed-precision GPU row's --amp (default: bf16)")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="every run's --batch_size (default: the tool's)")
    parser.add_argument("--budget_s", type=float, default=420,
                        help="wall-clock budget of all the runs together (default: 420)")
    parser.add_argument("--strict_goals", action="store_true",
                        help="exit 1 when a measured goal is not met too")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--logs", type=Path, default=None, help="keep each run's stderr here")
    add_quick_flag(parser)
    args = parser.parse_args(argv)
    args.model_names = args.models or list(QUICK_MODELS if args.quick else MODELS)
    args.threads = args.threads or (1 if args.quick else usable_cpus())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    cuda, ort = cuda_state(), ort_state()
    header = [cuda[1], f"onnxruntime {ort['version']}: providers {', '.join(ort['providers'])}",
              ort["note"],
              f"threads: --num_threads {args.threads} for every run ({usable_cpus()} usable CPUs"
              f"{'; --quick' if args.quick else ''})"]
    if args.quick:
        header.append("--quick: 1-2 epochs, the smallest models; its figures mean nothing")
    for line in header:
        print(line, flush=True)
    rows = plan(args.model_names, args.quick, args.gpu_amp)
    run_all(rows, cuda, args.threads, args.batch_size, args.budget_s, args.logs)
    judged = goals(rows, args.gpu_amp)
    print_results(rows, judged, header)
    failed = [f"{r.model} {r.device} {r.amp}: {f}" for r in rows for f in r.failures]
    if args.json:
        write_json(args.json, rows, judged, cuda, ort, args, time.perf_counter() - started)
    print(f"\nchecks: {'all passed' if not failed else f'{len(failed)} FAILED'} over "
          f"{sum(r.wall_seconds is not None for r in rows)} run(s); "
          f"{time.perf_counter() - started:.0f} s")
    missed = args.strict_goals and any(goal["met"] is False for goal in judged)
    return 1 if failed or missed else 0


def write_json(path: Path, rows: list[Row], judged: list[dict], cuda: tuple[bool, str],
               ort: dict, args: argparse.Namespace, seconds: float) -> None:
    import torch

    data = {"cuda": {"available": cuda[0], "line": cuda[1], "torch": torch.__version__,
                     "cuda_build": torch.version.cuda},
            "onnxruntime": ort, "threads": args.threads, "usable_cpus": usable_cpus(),
            "quick": args.quick, "gpu_amp": args.gpu_amp, "batch_size": args.batch_size,
            "budget_s": args.budget_s, "seconds": round(seconds, 1),
            "rows": [asdict(r) for r in rows], "goals": judged,
            "checks_failed": [f"{r.model} {r.device} {r.amp}: {f}"
                              for r in rows for f in r.failures]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"figures: {path}")


if __name__ == "__main__":
    sys.exit(main())
