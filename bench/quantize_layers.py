"""Issue 23's goals, measured side by side in one run, through the CLIs as a user types them:

    python bench/quantize_layers.py --sms DATA/sms_spam.tsv [--repeats 2] [--out DIR] [--quick]

(1) SMS (text, the default bag model) and builtin:breast_cancer (tabular MLP), each trained once
by pipeline.py, then quantized statically by quantize.py four ways on the same bundle:
today's op set (Conv/MatMul/Gemm), every op type ONNX Runtime can quantize (--quantize_ops all)
with no exclusion, --quantize_ops all --quantize_exclude auto, and --quantize_ops auto (both sets,
the wider kept only where the validation judge prefers it) with --quantize_exclude auto. The goal: auto-exclusion ends
within 1 point of fp32's accuracy while ≥ 1.2x faster than fp32 at batch 64, or the tool says
that no such set exists. Speed ratios are quantize.py's own: fp32 and int8 timed in turns on the
same test batches (p50 per batch of 64), --repeats times.
(2) The same search on builtin:digits with a CNN built to lose everything under full int8 (a
channel 1000x wider than the rest shares one activation scale with the informative ones): how
many steps it takes to recover, and what the verdict says.
(3) The digits CNN (builtin:digits, small_cnn): inference.py --profile at batch 1 and 64, the
top op type and node and their share of the kernel time.
Without --out the bundles go to a temporary folder, removed at the end.
--quick: 1 epoch, one repeat, one way per model (SMS: auto ops with auto exclusion; the hostile
CNN: default ops), the hostile CNN's bundle profiled in (3) at batch 64 alone, and a generated
stand-in for the SMS texts without --sms.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, add_quick_flag, sms_or_standin

GOAL_DROP, GOAL_SPEEDUP = 0.01, 1.2
STATIC_WAYS = {"default ops": [],
               "all ops": ["--quantize_ops", "all", "--quantize_exclude", "none"],
               "all ops, auto exclusion": ["--quantize_ops", "all", "--quantize_exclude", "auto"],
               "auto ops, auto exclusion": ["--quantize_ops", "auto", "--quantize_exclude",
                                            "auto"]}


def cli(script: str, *args: object) -> dict:
    """Run a CLI with its report on stdout; fail loudly with its stderr."""
    run = subprocess.run([sys.executable, str(REPO / script), *map(str, args), "--report_json",
                          "-", "--no_progress", "true"], capture_output=True, text=True,
                         cwd=REPO, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    if run.returncode != 0:
        sys.exit(f"{script} failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return json.loads(run.stdout)


def train(out: Path, *args: object) -> Path:
    model = out / "model.onnx"
    cli("pipeline.py", "--output_model", model, "--plots", "none", *args)
    return model


def quantize_row(model: Path, way: str, data: object) -> dict:
    """`data`: the --dataset_path the bundle was trained on (a bundle's own record is never
    read)."""
    q = cli("quantize.py", "--output_model", model, "--dataset_path", data, "--quantize",
            "static", *STATIC_WAYS[way])["quantize"]
    exclusion = q.get("exclusion") or {}
    return {"way": way, "test_fp32": q["accuracy_fp32"], "test_int8": q["accuracy"],
            "val_fp32": q["accuracy_val_fp32"], "val_int8": q["accuracy_val"],
            "speedup": q["latency_ms_p50_fp32"] / q["latency_ms_p50"],
            "used": q["used_for_inference"], "excluded": exclusion.get("excluded") or [],
            "steps": len(exclusion.get("steps") or []), "outcome": exclusion.get("outcome"),
            "worst": (q.get("layers") or [{}])[0].get("node"), "verdict": q["verdict"],
            "op_types": q["op_types"]}


def print_rows(name: str, rows: list[dict]) -> None:
    print(f"\n{name}")
    print(f"  {'way':<26} {'test fp32':>9} {'test int8':>9} {'val fp32':>8} {'val int8':>8} "
          f"{'int8/fp32 speed':>15} {'steps':>5} {'excluded':>8}  used")
    for r in rows:
        print(f"  {r['way']:<26} {r['test_fp32']:>9.4f} {r['test_int8']:>9.4f} "
              f"{r['val_fp32']:>8.4f} {r['val_int8']:>8.4f} {r['speedup']:>14.2f}x "
              f"{r['steps']:>5} {len(r['excluded']):>8}  {r['used']}")
    for r in rows:
        if r["outcome"]:
            print(f"  auto exclusion: {r['outcome']}; excluded {r['excluded'] or 'none'}")
            drop = r["test_fp32"] - r["test_int8"]
            met = drop <= GOAL_DROP and r["speedup"] >= GOAL_SPEEDUP and r["used"]
            honest = not r["used"] and "inference uses fp32" in r["verdict"]
            print(f"  goal (within {GOAL_DROP:g} of fp32 and >= {GOAL_SPEEDUP}x at batch 64): "
                  f"{'MET' if met else 'not met, and said so' if honest else 'NOT MET'} "
                  f"(test drop {drop:+.4f}, {r['speedup']:.2f}x)")
            print(f"  verdict: {r['verdict']}")
            if r["way"].startswith("auto ops"):
                print(f"  --quantize_ops auto kept: {', '.join(r['op_types'])}")


def profile_rows(model: Path, out: Path, batches: tuple[int, ...] = (1, 64)) -> None:
    print("\ndigits CNN: inference.py --profile")
    for batch in batches:
        report = cli("inference.py", "--model", model, "--batch_size", batch, "--profile", "true")
        section = report["profile"]
        top = section["top"][0]
        kinds = section["by_op_type"][:3]
        print(f"  batch {batch:>2}: {section['runs']} runs, {section['ms_per_run']:.4f} ms/run; "
              f"top node {top['node']} ({top['op_type']}) {top['share']:.1%}; top op types "
              + ", ".join(f"{k['op_type']} {k['share']:.1%}" for k in kinds))


HOSTILE_NET = REPO / "tests" / "hostile_net.py"  # the --model_def the tests use too


def hostile_rows(out: Path, epochs: int = 10, ways: tuple[str, ...] = (
        "default ops", "all ops, auto exclusion")) -> Path:
    """The hostile CNN's rows and auto exclusion's steps; its bundle."""
    folder = out / "hostile"
    folder.mkdir(parents=True, exist_ok=True)
    model = train(folder, "--dataset_path", "builtin:digits", "--model_def",
                  f"{HOSTILE_NET}:build", "--epochs", epochs)
    print_rows("digits, a CNN built to lose under int8 (static)",
               [quantize_row(model, way, "builtin:digits") for way in ways])
    steps = cli("quantize.py", "--output_model", model, "--quantize", "static",
                "--quantize_exclude", "auto")["quantize"]["exclusion"]["steps"]
    print("  default ops with auto exclusion, step by step (validation accuracy int8 / fp32):")
    for k, step in enumerate(steps):
        print(f"    {k}: {step['accuracy_val']:.4f} / {step['accuracy_val_fp32']:.4f}, "
              f"{step['latency_ms_p50']:.3g} / {step['latency_ms_p50_fp32']:.3g} ms, "
              f"kept in fp32: {', '.join(step['excluded']) or '-'}")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sms", type=Path, help="the SMS spam TSV (label, text); required "
                        "but with --quick")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="keep the bundles here (default: "
                        "a temporary folder, removed)")
    add_quick_flag(parser)
    args = parser.parse_args()
    if not args.sms and not args.quick:
        parser.error("the following arguments are required: --sms")
    if args.quick:
        args.repeats = 1
    sms = Path(sms_or_standin(args.sms, args.quick)).resolve()
    if args.out:
        measure(args, sms, args.out)
        print(f"\nbundles in {args.out}")
        return
    with tempfile.TemporaryDirectory(prefix="bench_quantize_") as tmp:
        measure(args, sms, Path(tmp))


def measure(args: argparse.Namespace, sms: Path, out: Path) -> None:
    cases = {"SMS (text, bag)": ["--model_type", "text_classifier", "--dataset_path", sms],
             "breast_cancer (tabular, mlp)": ["--model_type", "tabular_classifier",
                                              "--dataset_path", "builtin:breast_cancer"]}
    if args.quick:  # one case, two ways, the hostile CNN's bundle profiled
        cases = {"SMS (text, bag)": cases["SMS (text, bag)"] + ["--epochs", 1]}
    ways = ("auto ops, auto exclusion",) if args.quick else tuple(STATIC_WAYS)
    for name, flags in cases.items():
        model = train(out / name.split()[0].lower(), *flags)
        for k in range(args.repeats):
            data = flags[flags.index("--dataset_path") + 1]
            print_rows(f"{name}, repeat {k + 1}", [quantize_row(model, w, data) for w in ways])
    if args.quick:
        profile_rows(hostile_rows(out, 1, ("default ops",)), out, (64,))
        return
    hostile_rows(out)
    digits = train(out / "digits", "--dataset_path", "builtin:digits", "--epochs", "10")
    profile_rows(digits, out)


if __name__ == "__main__":
    main()
