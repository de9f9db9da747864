"""What the report's pictures cost the main job (issue 20's goal: ≤ 1 s for metrics + plots + page).

    python bench/report_cost.py --runs 5 [--quick]

runs the README's first command (pipeline.py on builtin:digits) as a subprocess, alternately
with its pictures (`--report_json R.json`: the plots beside it, the page) and without them
(`--plots none --report_json -`), and prints the median wall and CPU time of each, their
differences, and the in-run time of the drawing step (`seconds_visuals`) and of the evaluation section. On a
shared machine identical runs of the main job vary by seconds, more than the pictures cost, so
it also measures the pictures' own work directly: in a fresh interpreter, importing matplotlib
and plots.py (in a run, a thread does this during training: ttc.reporting.run.preload_plots) and drawing
the plots and the page of the last run's report. --quick: one run of each, 1 epoch.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, add_quick_flag

MAIN_JOB = ["--model_type", "image_classifier", "--dataset_path", "builtin:digits"]


def run_main_job(folder: Path, pictures: bool, extra_flags: tuple = ()
                 ) -> tuple[float, float, dict]:
    report = folder / "report.json"
    extra = ["--report_json", str(report)] if pictures else ["--plots", "none",
                                                             "--report_json", "-"]
    started, cpu_before = time.perf_counter(), children_cpu()
    proc = subprocess.run([sys.executable, str(REPO / "pipeline.py"), *MAIN_JOB,
                           "--output_model", str(folder / "model.onnx"), *extra,
                           *extra_flags],
                          capture_output=True, text=True, check=True)
    wall, cpu = time.perf_counter() - started, children_cpu() - cpu_before
    return wall, cpu, json.loads(report.read_text() if pictures else proc.stdout)


def children_cpu() -> float:
    """User + system CPU seconds of the finished child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def evaluation_seconds(report: dict, repeats: int = 200) -> float:
    """The evaluation section's own cost on this run's test split (built from a tally of
    synthetic predictions of the same size and class count)."""
    sys.path.insert(0, str(REPO))
    import numpy as np

    from ttc.reporting.evaluation import Tally, evaluation_section

    labels = report["evaluation"]["labels"]
    rng = np.random.default_rng(0)
    probabilities = rng.dirichlet(np.ones(len(labels)), report["evaluation"]["samples"])
    y = rng.integers(0, len(labels), len(probabilities))
    started = time.perf_counter()
    for _ in range(repeats):
        evaluation_section(Tally(len(labels)).add(probabilities, y), labels, None)
    return (time.perf_counter() - started) / repeats


COLD_DRAW = """
import json, sys, tempfile, time
from pathlib import Path
started = time.perf_counter()
from ttc.reporting import run as report
from ttc.reporting import plots
imported = time.perf_counter()
data = json.loads(Path(sys.argv[1]).read_text())
with tempfile.TemporaryDirectory() as tmp:
    report.write_visuals(data, Path(tmp) / "plots", Path(tmp) / "report.html", strict=True)
print(imported - started, time.perf_counter() - imported)
"""


def cold_cost(report_path: Path, repeats: int) -> tuple[float, float]:
    """The pictures' own work, in a fresh interpreter each time as in a run: (import of
    matplotlib and plots.py, drawing the plots and the page), medians in seconds."""
    times = [tuple(map(float, subprocess.run(
        [sys.executable, "-c", COLD_DRAW, str(report_path)], cwd=REPO, capture_output=True,
        text=True, check=True).stdout.split())) for _ in range(repeats)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each kind (alternating)")
    add_quick_flag(parser)
    args = parser.parse_args()
    extra_flags = ("--epochs", "1") if args.quick else ()
    if args.quick:
        args.runs = 1
    walls: dict[bool, list[float]] = {True: [], False: []}
    cpus: dict[bool, list[float]] = {True: [], False: []}
    visuals: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.runs):
            for pictures in ((True, False) if k % 2 == 0 else (False, True)):
                folder = Path(tmp) / f"{k}-{pictures}"
                wall, cpu, report = run_main_job(folder, pictures, extra_flags)
                walls[pictures].append(wall)
                cpus[pictures].append(cpu)
                if pictures:
                    visuals.append(report["seconds_visuals"])
                    plots = list(report["plots"])
                    saved = Path(tmp) / "saved.json"
                    saved.write_text(json.dumps(report))
                print(f"run {k + 1} {'with' if pictures else 'without'} pictures: "
                      f"{wall:.2f} s wall, {cpu:.2f} s CPU", file=sys.stderr)
        imported, drawn = cold_cost(saved, args.runs)
    with_, without = statistics.median(walls[True]), statistics.median(walls[False])
    print(f"main job, median of {args.runs} runs each (wall, s): with plots + page "
          f"{with_:.2f}, without {without:.2f}, difference {with_ - without:+.2f}")
    cpu_with, cpu_without = statistics.median(cpus[True]), statistics.median(cpus[False])
    print(f"main job, median CPU time (user + system, s): with {cpu_with:.2f}, without "
          f"{cpu_without:.2f}, difference {cpu_with - cpu_without:+.2f}")
    print(f"drawing step in the run (seconds_visuals): median {statistics.median(visuals):.3f} s "
          f"(min {min(visuals):.3f}, max {max(visuals):.3f}); plots: {', '.join(plots)}")
    print(f"the pictures' own work, fresh interpreter, median of {args.runs}: import "
          f"{imported:.3f} s (hidden by training in a run), plots + page {drawn:.3f} s, total "
          f"{imported + drawn:.3f} s")
    repeats = 5 if args.quick else 200
    print(f"evaluation section: {evaluation_seconds(report, repeats) * 1000:.2f} ms")


if __name__ == "__main__":
    main()
