"""Training on Ray (`--engine ray`) against the local run (issue 45), measured side by side in one
run:

    python bench/ray_train.py [--sms PATH] [--seeds 3] [--digits_epochs 20] [--sms_epochs 3]
                              [--search_epochs 100] [--lr_candidates 1e-3,2e-3,3e-3,5e-3]
                              [--workers 2] [--cpus 2] [--bandwidth_gbit 10] [--images 400]
                              [--quick]

1. The digits CNN (builtin:digits) and the SMS transformer (`--arch transformer`, our own small
   encoder, on the SMS Spam Collection: --sms PATH, else the SMS part is skipped), each trained by `pipeline.py` on
   seeds 0..N-1 with the local engine (1 thread) and with `--engine ray --num_workers 2
   --num_threads 1` (a local cluster of --cpus CPUs): test accuracy of the exported model (the
   report's inference.accuracy), mean ± std per engine and the per-seed difference ray - local,
   judged against the goal (within 0.5 points) and against the seeds' spread; the start-up
   (the report's train.engine.cluster_start_s, and train.seconds minus the epochs' seconds:
   everything before and between the epochs), seconds per epoch, the all-reduce share, and the
   crossover on paper: from the measured compute and all-reduce per step, where N workers pay.
2. A candidate search of 4 learning rates on digits (--search_epochs epochs, --patience 0 so
   every trial runs them all): `train.py --lr_candidates ...` sequentially (local, 1 thread)
   against `--engine ray` (Ray Tune trials, 1 thread each, --workers at once): the command's
   wall seconds, the ratio (goal ≤ 0.6x) and whether the winner is the same.
3. Where a worker's shard should come from: the driver decodes the training split once (it
   needs it whole for the later stages) and puts each worker's decoded shard in the object
   store; a worker decoding its shard's files itself would do that work a second time to save
   only the decoded rows' transfer. This part times the data code (ttc/inputs/data.py
   load_dataset, as a worker would run it) per image on --images generated photos of two kinds
   (64x64 PNG; 640x480 JPEG, resized to 64x64) and sets it against sending the decoded image
   (3 x 64 x 64 float32) at --bandwidth_gbit: on paper for the network, measured for the
   decoding.

Every run is a CLI subprocess, pinned to --cpus CPUs (Ray's local cluster gets the CPUs of the
affinity mask), whose --report_json is read back. --quick: digits only, 1 seed, 1 epoch, 2
learning rates, through the same functions; its figures mean nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common import REPO, add_quick_flag, scratch_dir

GOAL_POINTS = 0.5  # |test accuracy ray - local| in points
GOAL_SEARCH = 0.6  # ray / local wall time of the candidate search
CPU_LIMIT: list[int] = []  # the CPUs the CLI runs may use; empty: all
# what pipeline.py does beyond training and the test accuracy, left out (no figure reads it)
PIPELINE_EXTRAS = ["--plots", "none", "--calibrate", "none"]


@dataclass
class Run:
    """One CLI run: what its report says, and the command's wall seconds."""

    engine: str
    seed: int
    wall: float
    report: dict

    @property
    def train(self) -> dict:
        return self.report["train"]

    @property
    def epochs(self) -> list[float]:
        return self.train["engine"]["epoch_seconds"]

    @property
    def accuracy(self) -> float:
        return self.report["inference"]["accuracy"]

    @property
    def startup(self) -> float:
        """Training's seconds outside its epochs: data to workers, cluster and workers' start."""
        return self.train["seconds"] - sum(self.epochs)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.train["samples"] / self.report["config"]["batch_size"])


@dataclass
class Case:
    """A data set and network of part 1."""

    name: str
    data: list[str]
    epochs: int


def limit_cpus() -> None:
    """In the child, before the CLI starts: keep it (and a local Ray cluster) to CPU_LIMIT."""
    if CPU_LIMIT:
        os.sched_setaffinity(0, CPU_LIMIT)


def run_cli(script: str, args: list[str], out: Path, engine: str, seed: int) -> Run:
    """One `script` run with --report_json; it must exit 0."""
    out.mkdir(parents=True, exist_ok=True)
    report = out / "report.json"
    command = [sys.executable, str(REPO / script), *args, "--seed", str(seed),
               "--num_threads", "1", "--output_model", str(out / "model.onnx"),
               "--report_json", str(report), "--no_progress", "true"]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                          preexec_fn=limit_cpus)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{script} {' '.join(args)} failed ({done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    return Run(engine, seed, wall, json.loads(report.read_text()))


def engine_args(engine: str, workers: int) -> list[str]:
    return ["--engine", "ray", "--num_workers", str(workers)] if engine == "ray" else []


def train_case(case: Case, seeds: int, workers: int) -> dict[str, list[Run]]:
    """pipeline.py on each seed with each engine, local first; prints one row per run."""
    print(f"\n1. {case.name}, {case.epochs} epochs, seeds 0-{seeds - 1}, local (1 thread) vs "
          f"ray ({workers} workers x 1 thread):")
    print(f"   {'engine':<6} {'seed':>4} {'test accuracy':>13} {'wall s':>7} {'train s':>7} "
          f"{'start-up s':>10} {'cluster start s':>15} {'s/epoch':>7} {'all-reduce share':>16}")
    runs: dict[str, list[Run]] = {"local": [], "ray": []}
    for seed in range(seeds):
        for engine in runs:
            run = run_cli("pipeline.py", [*case.data, "--epochs", str(case.epochs),
                                          *engine_args(engine, workers), *PIPELINE_EXTRAS],
                          scratch_dir(), engine, seed)
            runs[engine].append(run)
            facts = run.train["engine"]
            share = facts.get("allreduce_share")
            print(f"   {engine:<6} {seed:>4} {run.accuracy:>13.4f} {run.wall:>7.1f} "
                  f"{run.train['seconds']:>7.1f} {run.startup:>10.1f} "
                  f"{facts.get('cluster_start_s') or 0:>15.1f} {np.mean(run.epochs):>7.2f} "
                  f"{'-' if share is None else f'{share:.1%}':>16}", flush=True)
    return runs


def accuracy_verdict(runs: dict[str, list[Run]]) -> None:
    """Mean ± std per engine, the paired difference ray - local and how it is judged."""
    local = np.array([r.accuracy for r in runs["local"]]) * 100
    ray = np.array([r.accuracy for r in runs["ray"]]) * 100
    diff = ray - local
    std = (lambda a: float(np.std(a, ddof=1)) if len(a) > 1 else float("nan"))
    spread = (lambda a: f" ± {std(a):.2f}" if len(a) > 1 else "")
    tests = runs["local"][0].report["inference"]["samples"]
    print(f"   test accuracy (points, {len(local)} seed(s), {tests} test samples: one sample "
          f"= {100 / tests:.2f} points): local {local.mean():.2f}{spread(local)}, "
          f"ray {ray.mean():.2f}{spread(ray)}")
    mean = float(diff.mean())
    met = "met" if abs(mean) <= GOAL_POINTS else "NOT met"
    print(f"   difference ray - local, per seed {', '.join(f'{d:+.2f}' for d in diff)}: mean "
          f"{mean:+.2f}{spread(diff)} points: goal (|mean| ≤ {GOAL_POINTS} points) {met}")
    if len(diff) < 2:
        print("   verdict: one seed, no spread to judge the difference against")
        return
    error = std(diff) / math.sqrt(len(diff))
    noise = "within" if abs(mean) <= 2 * error else "outside"
    print(f"   verdict: the mean difference is {noise} 2 standard errors of the paired "
          f"differences (2 x {error:.2f} = {2 * error:.2f} points; the seeds themselves spread "
          f"{std(local):.2f} points locally): "
          f"{'no difference the seeds can tell' if noise == 'within' else 'a real difference'}")


def timing_summary(runs: dict[str, list[Run]]) -> None:
    """Start-up, per-epoch seconds and the all-reduce share, means over the seeds."""
    local, ray = runs["local"], runs["ray"]
    cluster = np.mean([r.train["engine"]["cluster_start_s"] for r in ray])
    start_local, start_ray = (np.mean([r.startup for r in rs]) for rs in (local, ray))
    wall_local, wall_ray = (np.mean([r.wall for r in rs]) for rs in (local, ray))
    epoch_local, epoch_ray = (np.mean([np.mean(r.epochs) for r in rs]) for rs in (local, ray))
    share = np.mean([r.train["engine"]["allreduce_share"] for r in ray])
    print(f"   start-up (train seconds minus the epochs): local {start_local:.1f} s, ray "
          f"{start_ray:.1f} s (cluster start {cluster:.1f} s): ray pays "
          f"{start_ray - start_local:.1f} s more before its first epoch")
    rest_local, rest_ray = (np.mean([r.wall - sum(r.epochs) for r in rs]) for rs in (local, ray))
    print(f"   whole command minus the epochs (Python, data, start-up, export, test): local "
          f"{rest_local:.1f} s, ray {rest_ray:.1f} s")
    print(f"   whole command: local {wall_local:.1f} s, ray {wall_ray:.1f} s; per epoch: local "
          f"{epoch_local:.2f} s, ray {epoch_ray:.2f} s = {epoch_local / epoch_ray:.2f}x local's "
          f"speed")
    print(f"   all-reduce share of ray's epochs: {share:.1%}")


def crossover(runs: dict[str, list[Run]], workers: int, bandwidth_gbit: float) -> None:
    """Where N workers pay, on paper: per step, compute C shrinks to C/N and an all-reduce A is
    added; the start-up T0 is paid once. The inputs are measured here; the network is assumed."""
    local, ray = runs["local"], runs["ray"]
    steps = local[0].steps_per_epoch
    n = workers
    compute = np.mean([np.mean(r.epochs) for r in local]) / steps
    allreduce = np.mean([np.sum(r.train["engine"]["allreduce_seconds"]) / (len(r.epochs) * steps)
                         for r in ray])
    ray_step = np.mean([np.mean(r.epochs) for r in ray]) / steps
    params = local[0].train["num_parameters"]
    bandwidth = bandwidth_gbit * 1e9 / 8  # bytes/s
    network = 2 * params * 4 / bandwidth
    saved = compute * (1 - 1 / n)
    t0 = np.mean([r.startup for r in ray]) - np.mean([r.startup for r in local])
    batch = local[0].report["config"]["batch_size"]
    print(f"   crossover, N = {n} workers: steps per epoch = ceil({local[0].train['samples']} / "
          f"{batch}) = {steps}; compute per step C = local s/epoch / steps = {compute * 1e3:.1f}"
          f" ms (validation included); all-reduce per step measured A = {allreduce * 1e3:.2f} ms; "
          f"ray's whole step here {ray_step * 1e3:.1f} ms")
    print(f"   on paper, a multi-node cluster at {bandwidth_gbit:g} Gbit/s (assumed): A_net = 2 "
          f"x P x 4 B / bandwidth = 2 x {params:,} x 4 B / {bandwidth / 1e9:.2f} GB/s = "
          f"{network * 1e3:.2f} ms")
    for label, a in (("measured here", allreduce), (f"at {bandwidth_gbit:g} Gbit/s", network)):
        pays = "pays" if saved > a else "does not pay"
        print(f"   per step, N workers pay when C x (1 - 1/N) > A: {saved * 1e3:.2f} ms vs "
              f"{a * 1e3:.2f} ms ({label}): {pays}")
    print(f"   model size: at this compute per step, N workers pay per step while P < "
          f"bandwidth x C x (1 - 1/N) / 8 B = {bandwidth * saved / 8:,.0f} parameters "
          f"(this network: {params:,})")
    if saved > network:
        repaid = t0 / (saved - network)
        print(f"   data size: the extra start-up T0 = {t0:.1f} s (as measured here) is repaid "
              f"after T0 / (C x (1 - 1/N) - A_net) = {repaid:,.0f} steps = "
              f"{repaid * batch:,.0f} samples trained = {repaid / steps:,.1f} epochs of this data")
    sync = np.mean([np.sum(r.train["engine"]["sync_seconds"]) / (len(r.epochs) * steps)
                    for r in ray])
    verdict = "ray pays after its start-up" if ray_step < compute else \
        "ray does not pay at any size"
    print(f"   on this machine ({len(CPU_LIMIT) or os.cpu_count()} CPUs, one node): ray step "
          f"{ray_step * 1e3:.1f} ms vs local {compute * 1e3:.1f} ms: {verdict}; a worker's "
          f"compute per step here (step - A - loss sync {sync * 1e3:.2f} ms) "
          f"{(ray_step - allreduce - sync) * 1e3:.1f} ms against C/N = {compute / n * 1e3:.1f} ms "
          "on paper")


def search(rates: str, epochs: int, workers: int) -> None:
    """The same candidate search on digits, sequential (local) then as Ray Tune trials."""
    count = len(rates.split(","))
    print(f"\n2. candidate search on builtin:digits, {count} learning rates ({rates}), "
          f"{epochs} epochs each (--patience 0), 1 thread per trial:")
    data = ["--dataset_path", "builtin:digits", "--epochs", str(epochs), "--patience", "0",
            "--lr_candidates", rates]
    runs = {engine: run_cli("train.py", [*data, *engine_args(engine, workers)], scratch_dir(),
                            engine, 0) for engine in ("local", "ray")}
    for engine, run in runs.items():
        facts = run.train["engine"]
        scores = ", ".join(f"{c['learning_rate']:g}: {c['val_accuracy']:.4f}"
                           for c in run.train["candidates"])
        extra = (f"; cluster start {facts['cluster_start_s']:.1f} s, Tuner "
                 f"{facts['search_seconds']:.1f} s, {facts['trials_at_once']} trials at once"
                 if engine == "ray" else "")
        print(f"   {engine:<5} wall {run.wall:6.1f} s, train {run.train['seconds']:6.1f} s, "
              f"winner {run.train['learning_rate']:g}{extra}")
        print(f"   {'':<5} val accuracy per candidate: {scores}")
    local, ray = runs["local"], runs["ray"]
    ratio = ray.wall / local.wall
    same = local.train["learning_rate"] == ray.train["learning_rate"]
    print(f"   ray / local wall time: {ratio:.2f}x (goal ≤ {GOAL_SEARCH}x: "
          f"{'met' if ratio <= GOAL_SEARCH else 'NOT met'}); train seconds alone "
          f"{ray.train['seconds'] / local.train['seconds']:.2f}x; same winner: {same}")


def cases(args: argparse.Namespace) -> list[Case]:
    """Digits, and the SMS transformer when its TSV is there (never under --quick)."""
    found = [Case("digits CNN (builtin:digits)", ["--dataset_path", "builtin:digits"],
                  args.digits_epochs)]
    sms = args.sms
    if args.quick:
        return found
    if not sms or not Path(sms).exists():
        print(f"SMS transformer: skipped, no SMS TSV (--sms PATH: {sms or 'not given'})",
              file=sys.stderr)
        return found
    found.append(Case(f"SMS transformer ({Path(sms).name}, --max_length {args.sms_max_length})",
                      ["--model_type", "text_classifier", "--dataset_path", sms,
                       "--label_column", "0", "--text_column", "1", "--arch", "transformer",
                       "--max_length", str(args.sms_max_length)], args.sms_epochs))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", help="the SMS Spam Collection TSV (label<TAB>text); without "
                        "it the SMS part is skipped")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--digits_epochs", type=int, default=20)
    parser.add_argument("--sms_epochs", type=int, default=3)
    parser.add_argument("--sms_max_length", type=int, default=64,
                        help="token ids per text (SMS texts: 95%% have ≤ 33 words)")
    parser.add_argument("--search_epochs", type=int, default=100,
                        help="each trial about 25 s alone on 2 cores: a shorter search is "
                        "Ray's start-up (a 10-epoch one took 25.7 s on Ray, 9.6 s locally)")
    parser.add_argument("--lr_candidates", default="1e-3,2e-3,3e-3,5e-3")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=2,
                        help="CPUs the runs (and so Ray's local cluster) may use")
    parser.add_argument("--bandwidth_gbit", type=float, default=10.0,
                        help="the network assumed for the crossover on paper")
    parser.add_argument("--images", type=int, default=400,
                        help="generated photos of each kind for part 3")
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.digits_epochs, args.search_epochs, args.images = 1, 1, 1, 8
        args.lr_candidates = ",".join(args.lr_candidates.split(",")[:2])
    if hasattr(os, "sched_getaffinity"):
        CPU_LIMIT[:] = sorted(os.sched_getaffinity(0))[:args.cpus]
    args.workers = min(args.workers, len(CPU_LIMIT) or args.workers)  # one CPU each
    for case in cases(args):
        runs = train_case(case, args.seeds, args.workers)
        accuracy_verdict(runs)
        timing_summary(runs)
        crossover(runs, args.workers, args.bandwidth_gbit)
    search(args.lr_candidates, args.search_epochs, args.workers)
    shard_source(args.images, args.bandwidth_gbit)


PHOTO_KINDS = {"64x64 PNG": ((64, 64), "png"), "640x480 JPEG": ((640, 480), "jpg")}


def write_photos(root: Path, count: int, size: tuple[int, int], suffix: str) -> None:
    """`count` photos per class (2 classes): smooth colour fields with noise, as photos
    compress (pure noise would not)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    width, height = size
    ramp = np.linspace(0, 1, width)[None, :, None] * np.linspace(0, 1, height)[:, None, None]
    for label in ("a", "b"):
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            colour = rng.random(3)[None, None, :]
            noise = rng.normal(0, 0.05, (height, width, 3))
            pixels = np.clip((ramp * colour + noise) * 255, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / label / f"{i}.{suffix}")


def shard_source(count: int, bandwidth_gbit: float) -> None:
    """Part 3: decoding a photo with the data code, against sending it decoded."""
    from ttc.inputs.data import DataOptions, load_dataset

    print(f"\n3. a worker's shard: decoding its photos (ttc/inputs/data.py load_dataset, "
          f"{2 * count} photos of each kind, 64x64 RGB float32) vs fetching them decoded at "
          f"{bandwidth_gbit:g} Gbit/s (on paper):")
    decoded_bytes = 3 * 64 * 64 * 4
    fetch_ms = decoded_bytes / (bandwidth_gbit * 1e9 / 8) * 1e3
    for kind, (size, suffix) in PHOTO_KINDS.items():
        root = scratch_dir() / "photos"
        write_photos(root, count, size, suffix)
        options = DataOptions(path=str(root), image_size=(64, 64), channels=3,
                              show_progress=False)
        seconds = []
        for _ in range(2):  # the best of two: the first also pays the decoders' first use
            started = time.perf_counter()
            dataset = load_dataset(options)
            seconds.append(time.perf_counter() - started)
        decode_ms = min(seconds) / (2 * count) * 1e3
        rows = sum(len(split) for split in dataset.splits.values())
        cheaper = "fetching the decoded photo" if fetch_ms < decode_ms else "decoding it again"
        print(f"   {kind:>13}: decode {decode_ms:.3f} ms/photo ({rows} decoded, best of 2), "
              f"fetch {decoded_bytes:,} B = {fetch_ms:.3f} ms/photo: decode / fetch = "
              f"{decode_ms / fetch_ms:.1f}x, {cheaper} is cheaper")


if __name__ == "__main__":
    main()
