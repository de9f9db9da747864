"""MC-dropout: three loop backends side by side, and what the passes buy in calibration.

    python bench/iterative_speed.py [--passes 16] [--epochs 20] [--seeds 5]
        [--train_augment false] [--weight_decay 0] [--only timing|seeds] [--data digits,sms]
        [--sms PATH] [--quick]

Trains the digits CNN and (with --sms PATH, the SMS Spam Collection TSV) the SMS text classifier
as pipeline.py does. For each: accuracy, NLL and ECE of a single pass and of MC-dropout with K
passes; then, in turns on the same batches of 1 and of 64 samples, the time of K passes with the
python backend (K session.run calls), the batched backend (K copies in one run) and the loop
backend (an ONNX Loop, one run), and each one's speed-up over python.

A test split of a few hundred samples with a handful of errors gives a noisy ECE, so with
--seeds N the calibration is measured again on N seeds (each its own split, initialisation and
dropout masks): ECE single -> MC per seed with the paired bootstrap interval of the change that
the report prints, the mean, and in how many seeds MC was lower.

Goals: MC-dropout has a lower ECE than a single pass; batched or loop ≥ 3x faster than python at
batch 1.

--quick: K = 2, 1 epoch, 3 timed turns, 2 seeds, on the SMS texts alone (without --data), a
generated stand-in for them without --sms.
"""
from __future__ import annotations

import argparse

import numpy as np
import onnx

from common import (Config, add_quick_flag, quiet_single_thread, run_cases, scratch_dir,
                    sms_or_standin, train_bundle)

CASES = {"digits": ("digits CNN", "image_classifier", "builtin:digits"),
         "sms": ("SMS text", "text_classifier", "")}  # the path comes from --sms
BACKENDS = ("python", "batched", "loop")


def measure(name: str, model_type: str, dataset_path: str, passes: int, epochs: int,
            runs: int) -> None:
    from ttc.testtime import iterative as it
    from ttc.serving.runtime import batches_of, create_session, session_runner, time_runners

    config = Config(model_type=model_type, dataset_path=dataset_path, epochs=epochs,
                    no_progress=True, output_model=str(scratch_dir() / "model.onnx"))
    dataset, _, paths, _ = train_bundle(config)
    x, y = dataset.test.x, dataset.test.y
    classes = len(dataset.labels)
    mc_model = onnx.load(str(paths.variant("mc")))
    single = session_runner(create_session(str(paths.onnx), config.cpu_runtime()))
    samplers = {}
    for backend in BACKENDS:
        graph = it.mc_model_for(backend, mc_model, passes, classes, seed=0)
        session = create_session(graph.SerializeToString(), config.cpu_runtime(),
                                 it.MC_SESSION_ARGS)
        output = "probabilities" if backend == "python" else it.PASSES_OUTPUT
        samplers[backend] = it.MCSampler(backend, passes, session_runner(session, output))
    batches = batches_of(x, 64)
    plain = np.concatenate([single(b) for b in batches])
    print(f"\n{name}: {len(x)} test samples, K = {passes}")
    print(f"{'':<22} {'accuracy':>8} {'NLL':>8} {'ECE':>8} {'confidence':>10} {'acc@90%':>8}")
    for label, probs in [("single pass", plain)] + [
            (f"MC-dropout ({backend})", samplers[backend](batches).mean) for backend in BACKENDS]:
        row = it.calibration_row(label, probs, y, 1, 1, passes)
        print(f"{label:<22} {row['accuracy']:>8.4f} {row['nll']:>8.4f} {row['ece']:>8.4f} "
              f"{probs.max(1).mean():>10.4f} {row['accuracy_at_90_coverage']:>8.4f}")
    print(f"{'batch':>5} " + " ".join(f"{b + ' ms':>11}" for b in BACKENDS)
          + f" {'batched/py':>10} {'loop/py':>8}")
    for size in (1, 64):
        sized = batches_of(x, size)
        runners = [lambda b, s=samplers[k]: s([b]) for k in BACKENDS]
        times = [float(np.median(t)) * 1e3 for t in time_runners(runners, sized, runs).seconds]
        print(f"{size:>5} " + " ".join(f"{t:>11.4f}" for t in times)
              + f" {times[0] / times[1]:>10.2f} {times[0] / times[2]:>8.2f}")


def calibration_over_seeds(name: str, model_type: str, dataset_path: str, passes: int,
                           epochs: int, seeds: int, training: dict) -> None:
    from ttc.testtime import iterative as it
    from ttc.reporting import metrics
    from ttc.serving.runtime import batches_of, create_session, session_runner

    print(f"\n{name}: calibration over {seeds} seeds, K = {passes} (batched backend)")
    print(f"{'seed':>4} {'test':>5} {'accuracy':>8} {'ECE single':>10} {'ECE MC':>8} "
          f"{'90% interval':>18} {'NLL single':>10} {'NLL MC':>8} {'confidence':>10}")
    changes = []
    for seed in range(seeds):
        config = Config(model_type=model_type, dataset_path=dataset_path, epochs=epochs,
                        seed=seed, no_progress=True, **training,
                        output_model=str(scratch_dir() / "model.onnx"))
        dataset, _, paths, _ = train_bundle(config)
        x, y = dataset.test.x, dataset.test.y
        batches = batches_of(x, 64)
        single = session_runner(create_session(str(paths.onnx), config.cpu_runtime()))
        graph = it.mc_model_for("batched", onnx.load(str(paths.variant("mc"))), passes,
                                len(dataset.labels), seed=seed)
        sampler = it.MCSampler("batched", passes, session_runner(
            create_session(graph.SerializeToString(), config.cpu_runtime(), it.MC_SESSION_ARGS),
            it.PASSES_OUTPUT))
        plain, mc = np.concatenate([single(b) for b in batches]), sampler(batches).mean
        low, high = metrics.ece_change_interval(plain, mc, y, seed=seed)
        one, many = (it.calibration_row(name, p, y, 1, 1, 1) for name, p in
                     (("single", plain), ("mc", mc)))
        changes.append(many["ece"] - one["ece"])
        print(f"{seed:>4} {len(y):>5} {one['accuracy']:>8.4f} {one['ece']:>10.4f} "
              f"{many['ece']:>8.4f} {f'[{low:+.4f}, {high:+.4f}]':>18} {one['nll']:>10.4f} "
              f"{many['nll']:>8.4f} {one['mean_confidence']:>6.4f}->{many['mean_confidence']:.4f}")
    lower = sum(c < 0 for c in changes)
    print(f"mean ECE change {np.mean(changes):+.4f}; MC lower in {lower} of {seeds} seeds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=1,
                        help="also measure calibration on this many seeds (default: 1, none)")
    parser.add_argument("--train_augment", choices=("true", "false"), default="true",
                        help="for --seeds: shift augmentation of training images")
    parser.add_argument("--weight_decay", type=float, default=Config.weight_decay,
                        help="for --seeds: AdamW weight decay")
    parser.add_argument("--data", help="which of digits,sms to run (default: both; with "
                        "--quick: sms)")
    parser.add_argument("--sms", help="the SMS Spam Collection TSV (label<TAB>text); "
                        "without it the SMS case is skipped")
    parser.add_argument("--only", choices=("timing", "seeds"),
                        help="run only the timing part or only the calibration over seeds")
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.passes, args.epochs, args.runs, args.seeds = 2, 1, 3, 2
    args.data = args.data or ("sms" if args.quick else "digits,sms")
    args.sms = sms_or_standin(args.sms, args.quick)
    quiet_single_thread(args.quick)
    names = args.data.split(",")
    if "sms" in names and not args.sms:
        import sys

        print("SMS text: skipped; pass --sms PATH (the SMS Spam Collection TSV)", file=sys.stderr)
        names.remove("sms")
    cases = [CASES[name][:2] + (args.sms,) if name == "sms" else CASES[name] for name in names]
    if args.only != "seeds":
        run_cases(cases, measure, args.passes, args.epochs, args.runs)
    if args.seeds > 1 and args.only != "timing":
        training = {"train_augment": args.train_augment == "true",
                    "weight_decay": args.weight_decay}
        run_cases(cases, calibration_over_seeds, args.passes, args.epochs, args.seeds, training)


if __name__ == "__main__":
    main()
