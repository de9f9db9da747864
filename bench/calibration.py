"""Temperature scaling against no temperature, MC-dropout and ensembles, in distribution and
under shift (issue 21), and the temperature applied only on evidence against always (issue 41),
over several seeds, through the real commands.

    python bench/calibration.py [--seeds 5] [--sms_seeds N] [--first_seed 0] [--members 5]
                                [--sms sms_spam.tsv] [--datasets digits,sms] [--evidence]
                                [--quick]

Per seed: `pipeline.py` on builtin:digits with --ensemble_size MEMBERS and --eval_shift (every
image corruption, severity 3), then `inference.py --iterative mc_dropout --eval_shift` on the
same bundle; and, when --sms exists, `pipeline.py` on the SMS texts (--sms_seeds seeds, default
--seeds). The test-split figures come from each report's `calibration` section; the shift
figures from `calibration.shifts`. These runs use the default `--calibrate temperature`, so
"with T" is the tool's choice (T kept at 1 without evidence). For issue 41 each seed also runs
`pipeline.py --calibrate temperature_always` (no ensemble, no shift: the same network and fit),
and the bench prints test ECE and NLL without T, with the fitted T always and with the tool's
choice. --evidence runs only that comparison (plain pipeline.py runs, no ensembles, no shift).

Goals: issue 21: on both datasets, test ECE with the temperature ≤ without on at least 4 of 5
seeds and on the mean, NLL lower on the mean; under shift, report which variant is best
calibrated. Issue 41: test ECE with the tool's choice ≤ without T on ≥ 9 of 10 SMS seeds (90% of
the seeds run) and on every digits seed, and the mean NLL with the choice never above the mean
without T.

--quick: one seed, 2 members, 1 epoch, two corruptions, and a generated stand-in for the SMS
texts when --sms is not given.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

from common import REPO, add_quick_flag, scratch_dir, sms_or_standin

SHIFTS = "gaussian_noise,contrast,blur,shift,brightness"
QUICK_SHIFTS = "gaussian_noise,contrast"


def run(script: str, *args: object) -> dict:
    """A command of the tool with --report_json; its report."""
    out = scratch_dir() / "report.json"
    cmd = [sys.executable, str(REPO / script), *map(str, args), "--report_json", str(out),
           "--no_progress", "true", "--plots", "none", "--num_threads", "1"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def digits_seed(seed: int, members: int, corruptions: str = SHIFTS, training: tuple = ()
                ) -> tuple[dict, list[dict]]:
    """The calibration section of a digits run and its shift rows, MC-dropout's joined in."""
    model = scratch_dir() / "model.onnx"
    report = run("pipeline.py", "--model_type", "image_classifier", "--dataset_path",
                 "builtin:digits", "--seed", seed, "--ensemble_size", members, "--eval_shift",
                 corruptions, "--output_model", model, *training)
    mc = run("inference.py", "--model", model, "--iterative", "mc_dropout", "--seed", seed,
             "--eval_shift", corruptions)
    shifts = report["calibration"]["shifts"]
    for shift, other in zip(shifts, mc["calibration"]["shifts"]):
        shift["rows"] += [r for r in other["rows"] if r["variant"].startswith("mc_dropout")]
    clean = {r["variant"]: r for r in report["iterative"]["rows"] + mc["iterative"]["rows"]}
    shifts.insert(0, {"name": "clean", "rows": list(clean.values())})
    return report["calibration"], shifts


def sms_seed(seed: int, path: Path, training: tuple = ()) -> dict:
    model = scratch_dir() / "model.onnx"
    return run("pipeline.py", "--model_type", "text_classifier", "--dataset_path", path,
               "--label_column", "0", "--text_column", "1", "--seed", seed,
               "--output_model", model, *training)["calibration"]


def digits_plain(seed: int, training: tuple = ()) -> dict:
    """The calibration section of a plain digits run (no ensemble, no shift)."""
    return run("pipeline.py", "--model_type", "image_classifier", "--dataset_path",
               "builtin:digits", "--seed", seed, "--output_model",
               scratch_dir() / "model.onnx", *training)["calibration"]


ALWAYS = ("--calibrate", "temperature_always")
# "without T" is numpy's softmax of the logits, a T kept at 1 the graph's float32 softmax: equal
# up to this much in ECE or NLL
SAME = 1e-6


def print_rules(name: str, choice: list[dict], always: list[dict], seeds: range,
                need: int) -> None:
    """Issue 41: test ECE and NLL without T, with the fitted T always and with the tool's
    choice, per seed; the goal counts. `choice` and `always` are the calibration sections of
    runs of the same network under --calibrate temperature and temperature_always."""
    print(f"\n{name}: without T, with the fitted T always, with the tool's choice (test split)")
    print(f"  {'seed':>4} {'fitted T':>8} {'T 90% interval':>16} {'NLL gain 90% interval':>22} "
          f"{'applied':>7}  {'ECE none':>8} {'always':>7} {'choice':>7}  {'NLL none':>8} "
          f"{'always':>7} {'choice':>7}")
    rows = []
    for seed, c, a in zip(seeds, choice, always):
        if abs(c["ece_before"] - a["ece_before"]) > 1e-9:  # not the same network: say so
            print(f"  seed {seed}: the two runs trained different networks (ECE without T "
                  f"{c['ece_before']:.4f} and {a['ece_before']:.4f})")
        t_low, t_high = a.get("temperature_interval_90") or (float("nan"),) * 2
        g_low, g_high = a.get("nll_gain_interval_90") or (float("nan"),) * 2
        rows.append([c["ece_before"], a["ece_after"], c["ece_after"],
                     c["nll_before"], a["nll_after"], c["nll_after"]])
        print(f"  {seed:>4} {a['temperature']:>8.3f} {f'[{t_low:.2f}, {t_high:.2f}]':>16} "
              f"{f'[{g_low:+.4f}, {g_high:+.4f}]':>22} {'yes' if c.get('applied') else 'no':>7}"
              f"  {rows[-1][0]:>8.4f} {rows[-1][1]:>7.4f} {rows[-1][2]:>7.4f}  "
              f"{rows[-1][3]:>8.4f} {rows[-1][4]:>7.4f} {rows[-1][5]:>7.4f}")
    table = np.array(rows)
    means = table.mean(0)
    print(f"  mean ECE none {means[0]:.4f}, always {means[1]:.4f}, choice {means[2]:.4f}; "
          f"mean NLL none {means[3]:.4f}, always {means[4]:.4f}, choice {means[5]:.4f}")
    wins = int((table[:, 2] <= table[:, 0] + SAME).sum())
    always_wins = int((table[:, 1] <= table[:, 0] + SAME).sum())
    print(f"  goal ECE with the tool's choice ≤ without T on ≥ {need} of {len(rows)} seeds: "
          f"{wins} {'met' if wins >= need else 'NOT met'} (T always: {always_wins})")
    print(f"  goal mean NLL with the tool's choice ≤ without T: "
          f"{'met' if means[5] <= means[3] + SAME else 'NOT met'}")


def print_seeds(name: str, sections: list[dict], seeds: range) -> None:
    print(f"\n{name}: test split, without → with the temperature")
    print(f"  {'seed':>4} {'T':>7} {'method':>8} {'ECE before':>11} {'ECE after':>10} "
          f"{'NLL before':>11} {'NLL after':>10}  ECE change 90% interval")
    for seed, c in zip(seeds, sections):
        low, high = c["ece_change_interval_90"]
        print(f"  {seed:>4} {c['temperature']:>7.3f} {c['method']:>8} {c['ece_before']:>11.4f} "
              f"{c['ece_after']:>10.4f} {c['nll_before']:>11.4f} {c['nll_after']:>10.4f}  "
              f"[{low:+.4f}, {high:+.4f}]")
    ece = np.array([[c["ece_before"], c["ece_after"]] for c in sections])
    nll = np.array([[c["nll_before"], c["nll_after"]] for c in sections])
    wins = int((ece[:, 1] <= ece[:, 0]).sum())
    need = min(4, len(sections))
    print(f"  mean ECE {ece[:, 0].mean():.4f} → {ece[:, 1].mean():.4f}, mean NLL "
          f"{nll[:, 0].mean():.4f} → {nll[:, 1].mean():.4f}")
    print(f"  goal ECE with T ≤ without on ≥ {need} of {len(sections)} seeds: {wins} "
          f"{'met' if wins >= need else 'NOT met'}; on the mean: "
          f"{'met' if ece[:, 1].mean() <= ece[:, 0].mean() else 'NOT met'}")
    print(f"  goal NLL lower with T on the mean: "
          f"{'met' if nll[:, 1].mean() < nll[:, 0].mean() else 'NOT met'}")


def print_shifts(per_seed: list[list[dict]]) -> None:
    """ECE and accuracy per variant and corruption, the mean over seeds; the best variant."""
    names = [s["name"] for s in per_seed[0]]
    variants = [r["variant"] for r in per_seed[0][0]["rows"]]

    def mean(shift: int, variant: str, key: str) -> float:
        return float(np.mean([next(r[key] for r in seed[shift]["rows"]
                                   if r["variant"] == variant) for seed in per_seed]))

    print(f"\ndigits under shift (severity 3), mean over {len(per_seed)} seeds: ECE / accuracy")
    print(f"  {'variant':<14}" + "".join(f" {n[:15]:>16}" for n in names)
          + f" {'mean ECE shifted':>17}")
    shifted_means = {}
    for variant in variants:
        cells = "".join(f" {mean(k, variant, 'ece'):>7.4f} /{mean(k, variant, 'accuracy'):>7.4f}"
                        for k in range(len(names)))
        shifted_means[variant] = float(np.mean([mean(k, variant, "ece")
                                                for k in range(1, len(names))]))
        print(f"  {variant:<14}{cells} {shifted_means[variant]:>17.4f}")
    best = min(shifted_means, key=shifted_means.get)
    clean_best = min(variants, key=lambda v: mean(0, v, "ece"))
    print(f"  best calibrated in distribution: {clean_best}; under shift: {best}")
    wins = [sum(min(seed[k]["rows"], key=lambda r: r["ece"])["variant"] == v
                for seed in per_seed for k in range(1, len(names))) for v in variants]
    print("  lowest ECE per (seed, corruption): "
          + ", ".join(f"{v} {w}" for v, w in zip(variants, wins)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--sms_seeds", type=int, help="seeds of the SMS runs (default: --seeds)")
    parser.add_argument("--first_seed", type=int, default=0)
    parser.add_argument("--datasets", default="digits,sms")
    parser.add_argument("--members", type=int, default=5)
    parser.add_argument("--sms", type=Path, help="the SMS spam TSV (label, text); skipped "
                        "when not given")
    parser.add_argument("--evidence", action="store_true", help="issue 41 only: the tool's "
                        "choice against T always and no T (no ensembles, no shift)")
    add_quick_flag(parser)
    args = parser.parse_args()
    corruptions, training = SHIFTS, ()
    if args.quick:
        args.seeds, args.sms_seeds, args.members = 1, 1, 2
        corruptions, training = QUICK_SHIFTS, ("--epochs", 1)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    if "digits" in args.datasets:
        if args.evidence:
            choice = [digits_plain(seed, training) for seed in seeds]
        else:
            digits = [digits_seed(seed, args.members, corruptions, training) for seed in seeds]
            choice = [c for c, _ in digits]
            print_seeds("builtin:digits", choice, seeds)
            print_shifts([s for _, s in digits])
        always = [digits_plain(seed, (*training, *ALWAYS)) for seed in seeds]
        print_rules("builtin:digits", choice, always, seeds, len(seeds))
    if "sms" not in args.datasets:
        return
    sms = sms_or_standin(args.sms, args.quick)
    if sms and Path(sms).exists():
        seeds = range(args.first_seed, args.first_seed + (args.sms_seeds or args.seeds))
        name = f"SMS ({Path(sms).name})"
        choice = [sms_seed(seed, Path(sms), training) for seed in seeds]
        if not args.evidence:
            print_seeds(name, choice, seeds)
        always = [sms_seed(seed, Path(sms), (*training, *ALWAYS)) for seed in seeds]
        print_rules(name, choice, always, seeds, math.ceil(0.9 * len(seeds)))
    else:
        print(f"\nSMS: skipped, {args.sms} not found")


if __name__ == "__main__":
    main()
