"""Batched TTA vs a per-view loop, measured side by side in one run.

    python bench/tta_speed.py [--epochs 10] [--threads 1] [--sms PATH] [--quick]

Trains three models and gives each 4 views: the digits CNN (plain, hflip, vflip, rot180), the
SMS text classifier (plain and three token_dropout masks; the SMS Spam Collection TSV given
with --sms PATH, skipped without it) and the breast_cancer MLP (plain and three jitters). Then
times, in turns on the same batches of 1 and of 64 samples:

  plain      one session.run of the batch (no TTA)
  graph      the pipeline's TTA: views, model and merge in one ONNX graph, one session.run
  numpy      views stacked by numpy into one session.run, merged by numpy
  loop       one session.run per view (ttach's way), merged by numpy
  floor      one plain session.run of a batch 4× as large: what the 4 views' compute costs
             with no transform and no merge, the best any batching can do

and prints loop/graph (goal: ≥ 2 at batch 1), loop/floor (the ceiling of that ratio on this
machine) and the cost ratio graph/plain (goal: ≤ 1.1 × views at batch 64). --quick: 1 epoch, 3
timed turns, and a generated stand-in for the SMS texts without --sms.
"""
from __future__ import annotations

import argparse

import numpy as np

from common import (Config, add_quick_flag, quiet_single_thread, run_cases, scratch_dir,
                    sms_or_standin, train_bundle)

VIEWS = 4
CASES = [("digits CNN", "image_classifier", "builtin:digits", "hflip,vflip,rot180"),
         ("SMS text", "text_classifier", "",  # the path comes from --sms
          "token_dropout:0.1,token_dropout:0.15,token_dropout:0.2"),
         ("breast_cancer MLP", "tabular_classifier", "builtin:breast_cancer",
          "jitter:0.1,jitter:0.2,jitter:0.3")]


def measure(name: str, model_type: str, dataset_path: str, specs: str, epochs: int, runs: int,
            threads: int) -> None:
    from ttc.testtime.tta import tta_runner
    from ttc.serving.runtime import time_runners
    from ttc.serving.runtime import batches_of, create_session, session_runner
    from ttc.testtime.tta import TTARunner, merge
    from ttc.serving.bundle import read_manifest

    config = Config(model_type=model_type, dataset_path=dataset_path, epochs=epochs,
                    no_progress=True, num_threads=threads, tta_transforms=specs,
                    output_model=str(scratch_dir() / "model.onnx"))
    dataset, _, paths, _ = train_bundle(config)
    session = create_session(str(paths.onnx), config.cpu_runtime())
    predict = session_runner(session)
    x, y = dataset.test.x, dataset.test.y
    graph = tta_runner(session, paths.onnx, read_manifest(paths), config.tta_options(),
                       config.runtime())
    assert graph.backend == "onnx_graph"
    numpy_views = TTARunner(predict, graph.transforms, "mean", len(x))

    def loop(batch: np.ndarray) -> np.ndarray:  # one session.run per view
        probs = [predict(batch)] + [predict(v) for t in graph.transforms for v in t.views(batch)]
        return merge(np.concatenate(probs), None, len(batch), "mean")

    plain_acc = np.mean(np.concatenate([predict(b) for b in batches_of(x, 64)]).argmax(1) == y)
    graph_probs, numpy_probs = graph(x), numpy_views(x)
    print(f"\n{name}: {len(x)} test samples, views: plain + {specs} = {VIEWS}; accuracy plain "
          f"{plain_acc:.4f}, TTA {np.mean(graph_probs.argmax(1) == y):.4f}; graph vs numpy "
          f"max diff {np.abs(graph_probs - numpy_probs).max():.1e}; {threads} thread(s)")
    print(f"{'batch':>5} {'plain ms':>9} {'graph ms':>9} {'numpy ms':>9} {'loop ms':>9} "
          f"{'floor ms':>9} {'loop/graph':>10} {'loop/floor':>10} {'cost ratio':>10}")
    for size in (1, 64):
        batches = batches_of(x, size)
        quadruple = {id(b): np.ascontiguousarray(np.concatenate([b] * VIEWS)) for b in batches}
        floor = lambda b: predict(quadruple[id(b)])  # noqa: E731
        graph.batch_size = numpy_views.batch_size = size
        times = time_runners([predict, graph, numpy_views, loop, floor], batches, runs).seconds
        plain_ms, graph_ms, numpy_ms, loop_ms, floor_ms = (float(np.median(t)) * 1e3
                                                           for t in times)
        cost = graph_ms / plain_ms
        print(f"{size:>5} {plain_ms:>9.4f} {graph_ms:>9.4f} {numpy_ms:>9.4f} {loop_ms:>9.4f} "
              f"{floor_ms:>9.4f} {loop_ms / graph_ms:>10.2f} {loop_ms / floor_ms:>10.2f} "
              f"{cost:>7.2f} {'≤' if cost <= 1.1 * VIEWS else '>'} {1.1 * VIEWS:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--runs", type=int, default=200, help="timed turns per batch size")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    parser.add_argument("--sms", help="the SMS Spam Collection TSV (label<TAB>text); "
                        "without it the SMS case is skipped")
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.epochs, args.runs = 1, 3
    args.sms = sms_or_standin(args.sms, args.quick)
    quiet_single_thread()
    cases = [case[:2] + (args.sms,) + case[3:] if case[0] == "SMS text" else case
             for case in CASES if case[0] != "SMS text" or args.sms]
    if not args.sms:
        import sys

        print("SMS text: skipped; pass --sms PATH (the SMS Spam Collection TSV)", file=sys.stderr)
    run_cases(cases, measure, args.epochs, args.runs, args.threads)


if __name__ == "__main__":
    main()
