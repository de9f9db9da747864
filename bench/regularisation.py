"""Regularisation defaults, early stopping and the learning-rate schedule: the settings before
them against the defaults now, side by side in one run, on the same splits and seeds.

    python bench/regularisation.py --sst2_train sst2_train.tsv --sst2_dev sst2_dev.tsv \\
        --sms sms_spam.tsv [--seeds 3] [--epochs 20] [--jobs 1] [--only CASE,...] [--quick]

Each case trains with `before` (one-cycle schedule, every epoch, weight decay 1e-4, dropout
small_cnn 0.2, bag 0.3, cnn 0.3, transformer 0.1, mlp 0.2, resmlp 0.1, no max-norm) and with
the defaults (`after`; with --settings also `no_stop`, the defaults without early stopping),
on seeds 0..N-1 (each its own split and initialisation, the same for both), and
scores the test split: SST-2's dev set (--test_path; SST-2's test split is not used), the SMS
Spam Collection's and the builtin sets' own. It prints accuracy per seed and the mean, the
epochs run, the seconds, the gap between train and validation accuracy at the best epoch (what
the overfitting hint reads), and the goals:

  SST-2  cnn ≥ 0.79 and ≥ bag; bag no worse than before
  every  no network loses more than 0.3 points against before; early stopping no slower
  own    digits with a small CNN of its own (--model_def) within 2 points of a plain AdamW
         loop (constant rate 3e-3, batch 64, the same split and normalisation, no shifts) at
         5 and 20 epochs, with the default shift augmentation and without it

--jobs N trains N cases at once, each in a process of its own with one torch thread. --quick:
SST-2's bag and cnn and the own CNN, one seed, 2 epochs, in this process, stand-ins for the
missing files; its figures mean nothing.
"""
from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from common import Config, add_quick_flag, quiet_single_thread, scratch_dir, write_sms_standin

BEFORE_DROPOUT = {"small_cnn": 0.2, "bag": 0.3, "cnn": 0.3, "transformer": 0.1, "mlp": 0.2,
                  "resmlp": 0.1}
BEFORE = {"lr_schedule": "one_cycle", "patience": 0, "weight_decay": 1e-4, "max_norm": 0.0}
OWN_CNN = '''import torch.nn as nn


def build(num_classes, input_spec):
    """A small CNN of a user's own: two convolutions, no BatchNorm, no dropout."""
    return nn.Sequential(nn.Conv2d(input_spec["channels"], 16, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes))
'''
PLAIN_RATE, PLAIN_BATCH = 3e-3, 64


@dataclass
class Case:
    name: str
    data: dict  # Config's data flags
    arch: str | None = None  # None: --model_def (the own CNN)
    epochs: int | None = None  # None: --epochs


def cases(args) -> list[Case]:
    sst2 = {"model_type": "text_classifier", "dataset_path": args.sst2_train,
            "test_path": args.sst2_dev, "text_column": "0", "label_column": "1"}
    sms = {"model_type": "text_classifier", "dataset_path": args.sms, "text_column": "1",
           "label_column": "0"}
    found = [Case(f"SST-2 {arch}", sst2, arch) for arch in ("bag", "cnn", "transformer")]
    found += [Case(f"SMS {arch}", sms, arch) for arch in ("bag", "cnn", "transformer")]
    found.append(Case("digits small_cnn", {"dataset_path": "builtin:digits"}, "small_cnn"))
    for name in ("wine", "breast_cancer"):
        found += [Case(f"{name} {arch}", {"model_type": "tabular_classifier",
                                          "dataset_path": f"builtin:{name}"}, arch)
                  for arch in ("mlp", "resmlp")]
    for shifts in (True, False):  # the default shift augmentation, and without it
        found += [Case(f"own CNN {n} epochs" + ("" if shifts else ", no shifts"),
                       {"dataset_path": "builtin:digits", "train_augment": shifts}, None, n)
                  for n in ((2,) if args.quick else (5, 20))]
    if args.quick:  # one case of each kind of goal: the SST-2 pair and the own CNN with shifts
        found = [c for c in found if c.name in ("SST-2 bag", "SST-2 cnn", "own CNN 2 epochs")]
    return [c for c in found if not args.only or any(o in c.name for o in args.only.split(","))]


def config_for(case: Case, setting: str, seed: int, epochs: int, own: str) -> Config:
    flags = dict(case.data, seed=seed, epochs=case.epochs or epochs, no_progress=True,
                 output_model=str(scratch_dir() / "model.onnx"), calibrate="none")
    if case.arch is None:
        flags["model_def"] = f"{own}:build"
    else:
        flags["arch"] = case.arch
    if setting == "before":
        flags.update(BEFORE, dropout=BEFORE_DROPOUT.get(case.arch))
    if setting == "no_stop":  # the defaults but every epoch: what early stopping changes
        flags["patience"] = 0
    return Config(**flags)


def train_and_score(case: Case, setting: str, seed: int, epochs: int, own: str
                    ) -> tuple[float, int, float, float]:
    """Test accuracy, epochs run, seconds and the best epoch's train - validation accuracy gap
    of one training run (`plain`: the AdamW loop, no gap)."""
    quiet_single_thread()
    from ttc.inputs.data import DataOptions, load_dataset
    from ttc.nets.dspy_program import split_accuracy
    from ttc.nets.training import train_classifier

    config = config_for(case, setting, seed, epochs, own)
    dataset = load_dataset(DataOptions.from_config(config))
    started = time.perf_counter()
    if setting == "plain":
        net, run, gap = plain_adamw_loop(config, dataset), config.epochs, float("nan")
    else:
        trained = train_classifier(config, dataset)
        net, run = trained.net, len(trained.history)
        best = trained.history[trained.best_epoch - 1]
        gap = best.train_accuracy - best.val_accuracy
    return split_accuracy(net, dataset.test), run, time.perf_counter() - started, gap


def plain_adamw_loop(config: Config, dataset):
    """What a user writes by hand: AdamW at a constant rate, shuffled batches, every epoch, the
    last epoch's weights; the same network (and its input normalisation) as --model_def's."""
    import torch
    import torch.nn.functional as F

    from ttc.nets.models import build_model
    from ttc.nets.training import network_architecture

    torch.manual_seed(config.seed)
    net = build_model(network_architecture(config, dataset), dataset.preprocessing)
    optimizer = torch.optim.AdamW(net.parameters(), lr=PLAIN_RATE)
    x, y = torch.from_numpy(dataset.train.x), torch.from_numpy(dataset.train.y).long()
    generator = torch.Generator().manual_seed(config.seed)
    for _ in range(config.epochs):
        net.train()
        for batch in torch.randperm(len(x), generator=generator).split(PLAIN_BATCH):
            optimizer.zero_grad()
            F.cross_entropy(net(x[batch]), y[batch]).backward()
            optimizer.step()
    return net.eval()


def run_all(args, found: list[Case], own: str) -> dict:
    settings = args.settings.split(",")
    jobs = [(case, setting, seed) for case in found
            for setting in (settings + ["plain"] if case.arch is None else settings)
            for seed in range(args.seeds)]
    if args.jobs == 1:
        return {(case.name, setting, seed): train_and_score(case, setting, seed, args.epochs, own)
                for case, setting, seed in jobs}
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        futures = {(case.name, setting, seed): pool.submit(train_and_score, case, setting, seed,
                                                           args.epochs, own)
                   for case, setting, seed in jobs}
        return {key: future.result() for key, future in futures.items()}


def print_table(found: list[Case], results: dict, seeds: int) -> dict:
    print(f"{'case':<29} {'setting':<7} " + " ".join(f"seed{s:<3}" for s in range(seeds))
          + f" {'mean':>7} {'epochs':>7} {'seconds':>8} {'gap':>6}")
    means = {}
    for case in found:
        for setting in ("before", "no_stop", "after", "plain"):
            rows = [results[(case.name, setting, s)] for s in range(seeds)
                    if (case.name, setting, s) in results]
            if not rows:
                continue
            accuracy, epochs, seconds, gap = (np.mean([r[k] for r in rows]) for k in range(4))
            means[(case.name, setting)] = (accuracy, seconds)
            print(f"{case.name:<29} {setting:<7} " + " ".join(f"{r[0]:<7.4f}" for r in rows)
                  + f" {accuracy:>7.4f} {epochs:>7.1f} {seconds:>8.1f} {gap:>6.3f}")
    return means


def print_goals(means: dict) -> None:
    def mean(name: str, setting: str) -> float | None:
        return means.get((name, setting), (None, None))[0]

    print("\ngoals")
    cnn, bag = mean("SST-2 cnn", "after"), mean("SST-2 bag", "after")
    if cnn is not None and bag is not None:
        print(f"  SST-2 cnn {cnn:.4f} >= 0.79: {cnn >= 0.79}; >= bag {bag:.4f}: {cnn >= bag}; "
              f"bag vs before {bag - mean('SST-2 bag', 'before'):+.4f}")
    names = sorted({name for name, setting in means if setting == "before"})
    changes = {n: mean(n, "after") - mean(n, "before") for n in names
               if not n.startswith("own")}
    if changes:
        worst = min(changes, key=changes.get)
        print(f"  largest loss against before: {worst} {changes[worst]:+.4f} "
              f"(goal: no worse than -0.003): {changes[worst] >= -0.003}")
        slower = {n: means[(n, "after")][1] / max(means[(n, "before")][1], 1e-9) for n in names}
        print("  seconds after/before: " + ", ".join(f"{n} {r:.2f}" for n, r in slower.items()))
    for name in names:
        if name.startswith("own"):
            gap = mean(name, "after") - mean(name, "plain")
            print(f"  {name}: defaults {mean(name, 'after'):.4f}, plain AdamW loop "
                  f"{mean(name, 'plain'):.4f} ({gap:+.4f}; goal >= -0.02: {gap >= -0.02}), "
                  f"before {mean(name, 'before'):.4f}")


def standins(args) -> None:
    """--quick without the data files: stand-ins in the files' layouts."""
    if not args.sms:
        args.sms = str(write_sms_standin(scratch_dir() / "sms_standin.tsv"))
    if not (args.sst2_train and args.sst2_dev):
        folder = scratch_dir()
        for name, seed in (("sst2_train", 1), ("sst2_dev", 2)):
            sms = write_sms_standin(folder / f"{name}_sms.tsv", seed=seed).read_text()
            rows = [line.split("\t", 1) for line in sms.splitlines()]
            (folder / f"{name}.tsv").write_text(
                "".join(f"{text}\t{int(label == 'ham')}\n" for label, text in rows))
        args.sst2_train, args.sst2_dev = (str(folder / "sst2_train.tsv"),
                                          str(folder / "sst2_dev.tsv"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sst2_train")
    parser.add_argument("--sst2_dev")
    parser.add_argument("--sms")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--only", help="cases whose name contains one of these words")
    parser.add_argument("--settings", default="before,after",
                        help="before, after (the defaults), no_stop (the defaults but "
                        "--patience 0)")
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.epochs, args.jobs = 1, 2, 1
        standins(args)
    missing = [p for p in (args.sst2_train, args.sst2_dev, args.sms) if not p or
               not Path(p).exists()]
    if missing:
        parser.error(f"data not found: {missing}; give --sst2_train, --sst2_dev and --sms")
    own = scratch_dir() / "own_cnn.py"
    own.write_text(OWN_CNN)
    found = cases(args)
    started = time.perf_counter()
    means = print_table(found, run_all(args, found, str(own)), args.seeds)
    print_goals(means)
    print(f"\n{len(found)} cases, {args.seeds} seeds, {args.jobs} jobs: "
          f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
