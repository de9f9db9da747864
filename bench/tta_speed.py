"""TTA's two plans, a loop, the compute floor and ttach, measured side by side in one run.

    python bench/tta_speed.py [--epochs 10] [--threads 1] [--clock cpu] [--sms PATH] [--quick]

Trains three models and gives each 4 views: the digits CNN (plain, hflip, vflip, rot180), the
SMS text classifier (plain and three token_dropout masks; the SMS Spam Collection TSV given
with --sms PATH, skipped without it) and the breast_cancer MLP (plain and three jitters). Then,
for batches of 1, 8, 64 and 256 samples, opens TTA as inference.py does (tta_runner: --tta_plan
auto times both plans on one batch of that size and keeps the faster) and times, in turns on
the same batches:

  plain      one session.run of the batch (no TTA)
  graph      plan graph: views, model and merge in one ONNX graph, one session.run
  loop       plan loop: one session.run per view, merged by numpy (what ttach does in PyTorch)
  floor      one plain session.run of a batch 4× as large: what the 4 views' compute costs
             with no transform and no merge, the best any one-run batching can do
  TTA        the runner as tta_runner chose it (its plan in the `plan` column)
  ttach      digits only, where `import ttach` works (not a requirement of the tool):
             ttach.ClassificationTTAWrapper around the bundle's PyTorch model (model.pt) with
             the same 4 views (Compose of HorizontalFlip and VerticalFlip), merge mean, 1 torch
             thread; its outputs are checked against ours

Each figure is the median over the turns of this process's CPU time per call (--clock cpu:
with 1 thread, what the call costs on an idle core, however busy the machine; --clock wall:
elapsed time). It prints TTA/loop (goal: ≤ 1, never slower than a loop, within timing noise),
loop/graph, ttach/TTA (goals: ≥ 9 at batch 1, ≥ 2 at batch 64) and the cost ratio TTA/plain.
--quick: 1 epoch, batches of 1 and 8, 3 timed turns, and a generated stand-in for the SMS
texts without --sms.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from common import (Config, add_quick_flag, quiet_single_thread, run_cases, scratch_dir,
                    sms_or_standin, train_bundle)

VIEWS = 4
SIZES = (1, 8, 64, 256)
QUICK_SIZES = (1, 8)
CASES = [("digits CNN", "image_classifier", "builtin:digits", "hflip,vflip,rot180"),
         ("SMS text", "text_classifier", "",  # the path comes from --sms
          "token_dropout:0.1,token_dropout:0.15,token_dropout:0.2"),
         ("breast_cancer MLP", "tabular_classifier", "builtin:breast_cancer",
          "jitter:0.1,jitter:0.2,jitter:0.3")]
GOALS = {1: 9.0, 64: 2.0}  # ttach/TTA


def ttach_runner(paths, manifest):
    """ttach's TTA of the bundle's PyTorch model, the 4 views of the digits case (identity,
    vflip, hflip, hflip+vflip = rot180), merged by mean: a batch → probabilities; None (with a
    line saying so) where ttach is not installed."""
    try:
        import ttach
    except ImportError:
        print("ttach: not installed, its column is skipped (pip install ttach to fill it)")
        return None
    import torch

    from ttc.nets.models import WithProbabilities, load_weights

    net = WithProbabilities(load_weights(manifest, paths.weights).eval(), manifest.temperature)

    class Probabilities(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return net(x)[1]

    wrapper = ttach.ClassificationTTAWrapper(
        Probabilities(), ttach.Compose([ttach.HorizontalFlip(), ttach.VerticalFlip()]), "mean")

    def run(batch: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return wrapper(torch.from_numpy(batch)).numpy()

    return run


def tiled(x: np.ndarray, rows: int) -> np.ndarray:
    """x repeated to at least `rows` rows (the larger batches need more than a test split)."""
    return np.concatenate([x] * max(1, -(-rows // len(x))))


def time_turns(runners: list, batches: list[np.ndarray], runs: int, clock: str,
               warmup: int = 3) -> list[list[float]]:
    """Seconds of each runner's calls, taking turns on the same batches (as
    runtime.time_runners does, each turn starting one runner later, so that none always runs
    first after another's caches) by `clock`: "cpu", this process's CPU time (with 1 thread,
    what a call costs on an idle core: on a busy machine, wall time also counts the waits for
    other processes, which hit a long call more often than a short one), or "wall"."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    seconds: list[list[float]] = [[] for _ in runners]
    for i in range(warmup + runs):
        batch = batches[i % len(batches)]
        for j in range(len(runners)):
            k = (i + j) % len(runners)
            start = now()
            runners[k](batch)
            if i >= warmup:
                seconds[k].append(now() - start)
    return seconds


def measure(name: str, model_type: str, dataset_path: str, specs: str, epochs: int, runs: int,
            threads: int, sizes: tuple[int, ...], clock: str) -> None:
    from dataclasses import replace

    from ttc.serving.bundle import read_manifest
    from ttc.serving.runtime import batches_of, create_session, session_runner, whole_batches
    from ttc.testtime.tta import tta_runner

    config = Config(model_type=model_type, dataset_path=dataset_path, epochs=epochs,
                    no_progress=True, num_threads=threads, tta_transforms=specs,
                    output_model=str(scratch_dir() / "model.onnx"))
    dataset, _, paths, _ = train_bundle(config)
    manifest = read_manifest(paths)
    session = create_session(str(paths.onnx), config.cpu_runtime())
    predict = session_runner(session)
    x, y = dataset.test.x, dataset.test.y
    base = tta_runner(session, paths.onnx, manifest, config.tta_options(), config.runtime(), x)
    assert base.backend == "onnx_graph"
    graph, loop = base.with_plan("graph"), base.with_plan("loop")
    ttach = ttach_runner(paths, manifest) if model_type == "image_classifier" else None

    plain_acc = np.mean(np.concatenate([predict(b) for b in batches_of(x, 64)]).argmax(1) == y)
    graph_probs, loop_probs = graph(x), loop(x)
    print(f"\n{name}: {len(x)} test samples, views: plain + {specs} = {VIEWS}; accuracy plain "
          f"{plain_acc:.4f}, TTA {np.mean(graph_probs.argmax(1) == y):.4f}; graph vs loop: max "
          f"diff {np.abs(graph_probs - loop_probs).max():.1e}, argmax agreement "
          f"{np.mean(graph_probs.argmax(1) == loop_probs.argmax(1)):.4f}; {threads} thread(s), "
          f"{clock} time, median")
    if ttach is not None:
        theirs = ttach(x)
        print(f"ttach vs ours: max diff {np.abs(theirs - graph_probs).max():.1e}, argmax "
              f"agreement {np.mean(theirs.argmax(1) == graph_probs.argmax(1)):.4f}")
    print(f"{'batch':>5} {'plan':>5} {'plain ms':>9} {'graph ms':>9} {'loop ms':>9} "
          f"{'floor ms':>9} {'TTA ms':>9} {'ttach ms':>9} {'TTA/loop':>8} {'loop/graph':>10} "
          f"{'ttach/TTA':>9} {'cost ratio':>10}")
    data = tiled(x, 2 * max(sizes))
    for size in sizes:
        options = replace(config.tta_options(), batch_size=size)
        chosen = tta_runner(session, paths.onnx, manifest, options, config.runtime(), x)
        graph.batch_size = loop.batch_size = size
        batches = whole_batches(batches_of(data, size, manifest.input.pad_id), size)[:8]
        quadruple = {id(b): np.ascontiguousarray(np.concatenate([b] * VIEWS)) for b in batches}
        runners = [predict, graph, loop, lambda b: predict(quadruple[id(b)]), chosen]
        turns = max(min(runs, 20), runs * 16 // size)  # fewer turns of the larger batches
        times = time_turns(runners + ([ttach] if ttach else []), batches, min(runs, turns),
                           clock)
        plain_ms, graph_ms, loop_ms, floor_ms, tta_ms, *rest = (float(np.median(t)) * 1e3
                                                                for t in times)
        ttach_ms = rest[0] if rest else float("nan")
        goal = GOALS.get(size)
        versus = f"{ttach_ms / tta_ms:>9.2f}" if rest else f"{'-':>9}"
        print(f"{size:>5} {chosen.plan:>5} {plain_ms:>9.4f} {graph_ms:>9.4f} {loop_ms:>9.4f} "
              f"{floor_ms:>9.4f} {tta_ms:>9.4f} {ttach_ms:>9.4f} {tta_ms / loop_ms:>8.2f} "
              f"{loop_ms / graph_ms:>10.2f} {versus} {tta_ms / plain_ms:>10.2f}"
              + (f"   (goal ttach/TTA ≥ {goal:g})" if rest and goal else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--runs", type=int, default=200, help="timed turns per batch size")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: this process's CPU time per call (default; with 1 thread, "
                        "unaffected by other processes on the machine); wall: elapsed time")
    parser.add_argument("--sms", help="the SMS Spam Collection TSV (label<TAB>text); "
                        "without it the SMS case is skipped")
    add_quick_flag(parser)
    args = parser.parse_args()
    sizes = SIZES
    if args.quick:
        args.epochs, args.runs, sizes = 1, 3, QUICK_SIZES
    args.sms = sms_or_standin(args.sms, args.quick)
    quiet_single_thread(args.quick)
    cases = [case[:2] + (args.sms,) + case[3:] if case[0] == "SMS text" else case
             for case in CASES if case[0] != "SMS text" or args.sms]
    if not args.sms:
        print("SMS text: skipped; pass --sms PATH (the SMS Spam Collection TSV)", file=sys.stderr)
    run_cases(cases, measure, args.epochs, args.runs, args.threads, sizes, args.clock)


if __name__ == "__main__":
    main()
