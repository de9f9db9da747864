"""Temperature scaling against no temperature, MC-dropout and ensembles, in distribution and
under shift (issue 21), over several seeds, through the real commands.

    python bench/calibration.py [--seeds 5] [--first_seed 0] [--members 5] [--sms sms_spam.tsv]
                                [--datasets digits,sms] [--quick]

Per seed: `pipeline.py` on builtin:digits with --ensemble_size MEMBERS and --eval_shift (every
image corruption, severity 3), then `inference.py --iterative mc_dropout --eval_shift` on the
same bundle; and, when --sms exists, `pipeline.py` on the SMS texts. The test-split figures come
from each report's `calibration` section; the shift figures from `calibration.shifts`.

Goals: on both datasets, test ECE with the temperature ≤ without on at least 4 of 5 seeds and on
the mean, NLL lower on the mean; under shift, report which variant is best calibrated.

--quick: one seed, 2 members, 1 epoch, two corruptions, and a generated stand-in for the SMS
texts when --sms is not given.
"""
from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--first_seed", type=int, default=0)
    parser.add_argument("--datasets", default="digits,sms")
    parser.add_argument("--members", type=int, default=5)
    parser.add_argument("--sms", type=Path, help="the SMS spam TSV (label, text); skipped "
                        "when not given")
    add_quick_flag(parser)
    args = parser.parse_args()
    corruptions, training = SHIFTS, ()
    if args.quick:
        args.seeds, args.members, corruptions, training = 1, 2, QUICK_SHIFTS, ("--epochs", 1)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    if "digits" in args.datasets:
        digits = [digits_seed(seed, args.members, corruptions, training) for seed in seeds]
        print_seeds("builtin:digits", [c for c, _ in digits], seeds)
        print_shifts([s for _, s in digits])
    if "sms" not in args.datasets:
        return
    sms = sms_or_standin(args.sms, args.quick)
    if sms and Path(sms).exists():
        print_seeds(f"SMS ({Path(sms).name})",
                    [sms_seed(seed, Path(sms), training) for seed in seeds], seeds)
    else:
        print(f"\nSMS: skipped, {args.sms} not found")


if __name__ == "__main__":
    main()
