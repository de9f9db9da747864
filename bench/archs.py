"""Every --arch through the whole pipeline, one row per data set and network, measured side by
side in one run: parameters, seconds per epoch, test accuracy, ONNX Runtime fp32 latency at
batch 1 and at --batch_size, ORT's speed-up over PyTorch eager at batch 1, and int8's speed-up
over fp32 (with the quantizer's verdict).

    python bench/archs.py --sms DATA/sms_spam.tsv [--epochs 20] [--out runs/bench_archs]

Each row is a `pipeline.py` run as a user would type it (1 thread); its report JSON is read back.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def rows(sms: str | None) -> list[tuple[str, list[str], str]]:
    """(data name, data flags, quantize mode) per arch."""
    plan = [("digits", ["--dataset_path", "builtin:digits"], "static", "small_cnn")]
    for arch in ("mlp", "resmlp"):
        plan.append(("breast_cancer", ["--model_type", "tabular_classifier", "--dataset_path",
                                       "builtin:breast_cancer"], "static", arch))
    if sms:
        for arch in ("bag", "cnn", "transformer"):
            plan.append(("sms", ["--model_type", "text_classifier", "--dataset_path", sms,
                                 "--label_column", "0", "--text_column", "1"], "dynamic", arch))
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
    return {"data": name, "arch": arch, "parameters": train["num_parameters"],
            "s_per_epoch": train["seconds"] / max(1, train["epochs_run"]),
            "accuracy": report["inference"]["accuracy"],
            "ort_ms_batch1": fp32["latency_ms_p50_batch1"],
            "ort_ms_batch": report["inference"]["latency_ms_p50"],
            "batch": report["inference"]["batch_size"],
            "ort_over_eager_batch1": eager["latency_ms_p50_batch1"] / fp32["latency_ms_p50_batch1"],
            "int8_speedup": ratio, "int8_used": quant.get("used_for_inference")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", help="the SMS spam TSV (label, text); its rows are skipped "
                        "without it")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--out", default="runs/bench_archs")
    args = parser.parse_args()
    results = [run(*row, args.epochs, Path(args.out)) for row in rows(args.sms)]
    print(f"{'data':<14} {'arch':<12} {'params':>8} {'s/epoch':>8} {'test acc':>8} "
          f"{'ORT ms@1':>9} {'ORT ms@b':>9} {'ORT/eager@1':>11} {'int8 speed-up':>13}")
    for r in results:
        int8 = "n/a" if r["int8_speedup"] is None else \
            f"{r['int8_speedup']:.2f}x{' used' if r['int8_used'] else ''}"
        print(f"{r['data']:<14} {r['arch']:<12} {r['parameters']:>8} {r['s_per_epoch']:>8.2f} "
              f"{r['accuracy']:>8.4f} {r['ort_ms_batch1']:>9.3f} {r['ort_ms_batch']:>9.3f} "
              f"{r['ort_over_eager_batch1']:>10.1f}x {int8:>13}")
    print(json.dumps(results), file=sys.stderr)


if __name__ == "__main__":
    main()
