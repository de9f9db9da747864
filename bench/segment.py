"""Semantic segmentation (issue 43) measured side by side in one run: each --arch trained by
pipeline.py on digit canvases, its bundle checked and timed here, one table of goals.

    python bench/segment.py [--canvases 2000] [--size 64] [--epochs 18] [--learning_rate 1e-2]
                            [--batch_size 32] [--archs unet,lraspp_mobilenet_v3_large]
                            [--tta_transforms hflip] [--runs 200] [--out DIR] [--reexport]
                            [--quick]

The data: --canvases canvases of --size pixels written by
ttc.tasks.segment.canvases.write_digit_canvases (scikit-learn's digits, 11 classes; seed 0, the
same bytes every run), split 70/15/15 by pipeline.py. Each arch is one `pipeline.py
--model_type image_segmenter` run as a user would type it (1 thread, --lr_schedule one_cycle,
--tta true, --ttt true --eval_shift gaussian_noise,contrast,blur --shift_severity 3); its report
JSON gives the training time, the test mean IoU, the export check, flip-TTA's mean IoU change
and bn-TTT's mean IoU under the shifts. Then, on the test images and with 1 thread each:

  agreement   the masks of model.onnx (ONNX Runtime) against the rebuilt PyTorch network's
              (model.pt) on every test image at --size and at 1.5x --size pixels
  ORT/eager   model.onnx against PyTorch eager (the same graph: logits, probabilities, mask)
              at batch 1, timed in turns (runtime.time_runners) on the same images
  loop/graph  the in-graph TTA (model.tta.onnx, one session.run) against a loop of sessions:
              per view the batch transformed in numpy (a flip; a scale resized by
              torch.nn.functional.interpolate, as the graph does), model.onnx's logits mapped
              back, the views' logits averaged, argmax; its masks checked against the graph's,
              then both timed in turns at batch 1

int8: where the segmenter takes --quantize, the runs add --quantize static and the table gives
int8's test mean IoU and speed against fp32 from the report's quantize section (the test mean
IoU in the goals is fp32's either way); where it does not, the table says "int8: not built for
image_segmenter yet" instead of a figure. A pipeline.py run that fails is reported in its
arch's rows and the script exits 1 after the others. --quick: 120 canvases of 24 pixels, 1
epoch, the U-Net only, a few timed turns, bundles in a temporary folder; its figures mean
nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common import REPO, Config, add_quick_flag, quiet_single_thread, scratch_dir

DEFAULT_OUT = "runs/bench_segment"
DEFAULT_ARCHS = "unet,lraspp_mobilenet_v3_large"
SHIFTS = "gaussian_noise,contrast,blur"
CHECK_BATCH = 32
MIN_AGREEMENT = 0.9999
GOALS = {"unet": 0.80, "lraspp_mobilenet_v3_large": 0.70}  # test mean IoU
UNET_TRAIN_SECONDS = 600.0
ORT_OVER_EAGER = 2.0
GRAPH_OVER_LOOP = 1.5
TTT_GAIN = 0.10


@dataclass
class Measured:
    """One arch's figures: from its report JSON and from this script's own checks."""

    arch: str
    parameters: int
    epochs_run: int
    train_seconds: float
    pipeline_seconds: float
    val_mean_iou: float
    test_mean_iou: float  # fp32's
    export_agreement: float
    export_resolutions: list[str]
    tta_plain: float
    tta_mean_iou: float
    tta_cost_ratio: float
    ttt_source: float
    ttt_bn: float
    agreement: dict[str, float]  # "HxW" → share of test pixels whose masks agree
    eager_ms: float
    ort_ms: float
    loop_ms: float
    graph_ms: float
    loop_agreement: float
    int8: dict | None  # the report's quantize section, None without --quantize


@dataclass
class Failed:
    """An arch whose pipeline.py run failed: its last line."""

    arch: str
    error: str


# ----------------------------------------------------------------------------- pipeline runs


def pipeline_command(arch: str, data: Path, folder: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(REPO / "pipeline.py"), "--model_type", "image_segmenter",
            "--dataset_path", str(data), "--arch", arch, "--epochs", str(args.epochs),
            "--learning_rate", str(args.learning_rate), "--lr_schedule", "one_cycle",
            "--batch_size", str(args.batch_size), "--num_threads", str(args.threads),
            "--tta", "true", "--tta_transforms", args.tta_transforms, "--ttt", "true",
            "--eval_shift", SHIFTS, "--shift_severity", "3", "--plots", "none",
            "--no_progress", "true", "--output_model", str(folder / "model.onnx"),
            "--report_json", str(folder / "report.json"),
            *(["--quantize", "static"] if int8_built() else [])]


def int8_built() -> bool:
    """Whether a segmenter takes --quantize (refused with exit 2 before issue 43 built it)."""
    from ttc.tasks.segment import REFUSED_FLAGS

    return "quantize" not in REFUSED_FLAGS


def train(arch: str, data: Path, folder: Path, args: argparse.Namespace
          ) -> tuple[dict | None, float, str]:
    """(the report JSON or None, the run's wall seconds, its error line or "") of one
    pipeline.py run."""
    started = time.perf_counter()
    done = subprocess.run(pipeline_command(arch, data, folder, args), capture_output=True,
                          text=True, cwd=REPO)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        return None, seconds, f"pipeline.py failed (exit {done.returncode}): {lines[-1]}"
    return json.loads((folder / "report.json").read_text()), seconds, ""


# ----------------------------------------------------------------------------- own checks


def held_out_split(data: Path, manifest):
    """The test split pipeline.py evaluated: the same folder split by the same seed, decoded by
    the bundle's preprocessing."""
    from ttc.inputs.data import DataOptions, load_dataset

    config = Config(model_type="image_segmenter", dataset_path=str(data), no_progress=True)
    dataset = load_dataset(DataOptions.from_config(config),
                           preprocessing=manifest.preprocessing.spec, labels=manifest.labels,
                           splits=("test",))
    return dataset.test.x, dataset.test.y


def masks_of(run, x: np.ndarray) -> np.ndarray:
    return np.concatenate([run(x[i:i + CHECK_BATCH]) for i in range(0, len(x), CHECK_BATCH)])


def agreement_at(session, graph, x: np.ndarray, size: tuple[int, int]) -> float:
    """The share of pixels whose ONNX Runtime mask equals PyTorch's, the images resized to
    `size` (bilinear, as export.py's check resizes)."""
    import torch

    from ttc.tasks.segment.export import resized

    images = resized(x, size)

    def eager(batch: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return graph(torch.from_numpy(batch))[2].numpy()

    ours = masks_of(lambda b: session.run(["mask"], {"image": b})[0], images)
    return float(np.mean(ours == masks_of(eager, images)))


def view_functions(spec: str):
    """Per view of the spec (the identity first): (forward, back) on numpy arrays, from the one
    transform table (ttc/testtime/transforms.py) the segmenter's TTA graph is built from."""
    from ttc.tasks.segment.views import parse_view_specs
    from ttc.testtime.transforms import image_views

    return [(view.augment, view.deaugment_mask)
            for view in image_views(parse_view_specs(spec)[1:], "mask")]


def tta_loop(session, spec: str):
    """A batch → masks: model.onnx run once per view, the logits mapped back and averaged."""
    views = view_functions(spec)

    def run(batch: np.ndarray) -> np.ndarray:
        size = batch.shape[-2:]
        total = None
        for forward, back in views:
            logits = back(session.run(["logits"], {"image": forward(batch)})[0], size)
            total = logits if total is None else total + logits
        return (total / len(views)).argmax(1)

    return run


def check_bundle(folder: Path, data: Path, args: argparse.Namespace) -> dict:
    """This script's own figures for one bundle (see the module's docstring)."""
    import torch

    from ttc.nets.models import load_weights
    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.serving.runtime import create_session, time_runners
    from ttc.tasks.segment.export import second_size
    from ttc.tasks.segment.nets import SegmentationGraph

    paths = BundlePaths.from_model_path(folder / "model.onnx")
    manifest = read_manifest(paths)
    x, _ = held_out_split(data, manifest)
    runtime = Config(num_threads=args.threads).cpu_runtime()
    session = create_session(str(paths.onnx), runtime)
    merged = create_session(str(paths.variant("tta")), runtime)
    graph = SegmentationGraph(load_weights(manifest, paths.weights, False),
                              manifest.temperature).eval()
    height, width = x.shape[-2:]
    agreement = {f"{h}x{w}": agreement_at(session, graph, x, (h, w))
                 for h, w in ((height, width), second_size(height, width))}

    def eager(batch: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return graph(torch.from_numpy(batch))[2].numpy()

    def ort(batch: np.ndarray) -> np.ndarray:
        return session.run(["mask"], {"image": batch})[0]

    def in_graph(batch: np.ndarray) -> np.ndarray:
        return merged.run(["mask"], {"image": batch})[0]

    loop = tta_loop(session, args.tta_transforms)
    loop_agreement = float(np.mean(masks_of(loop, x) == masks_of(in_graph, x)))
    ones = [x[i:i + 1] for i in range(min(len(x), args.images))]
    minimum = 0.0 if args.quick else 1.0
    speed = time_runners([eager, ort], ones, runs=args.runs, min_seconds=minimum)
    tta = time_runners([loop, in_graph], ones, runs=args.runs, min_seconds=minimum)
    return {"agreement": agreement, "eager_ms": speed.percentile_ms(0, 50),
            "ort_ms": speed.percentile_ms(1, 50), "loop_ms": tta.percentile_ms(0, 50),
            "graph_ms": tta.percentile_ms(1, 50), "loop_agreement": loop_agreement}


def reexport(arch: str, data: Path, folder: Path, args: argparse.Namespace
             ) -> tuple[dict | None, float, str]:
    """--reexport: the bundle trained by an earlier run, exported again by this checkout's
    export.py (with its TTA graph); the training figures stay those of that run's report."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(REPO / "export.py"), "--dataset_path", str(data),
                           "--output_model", str(folder / "model.onnx"), "--tta", "true",
                           "--tta_transforms", args.tta_transforms, "--num_threads",
                           str(args.threads), "--no_progress", "true"],
                          capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        return None, 0.0, f"export.py failed (exit {done.returncode}): {lines[-1]}"
    LOG_REEXPORT.append(f"{arch}: re-exported in {time.perf_counter() - started:.1f} s")
    return json.loads((folder / "report.json").read_text()), math.nan, ""


LOG_REEXPORT: list[str] = []


def measure(arch: str, data: Path, out: Path, args: argparse.Namespace) -> Measured | Failed:
    folder = out / arch
    if args.reexport and (folder / "model.pt").is_file():
        report, seconds, error = reexport(arch, data, folder, args)
    else:
        report, seconds, error = train(arch, data, folder, args)
    if report is None:
        return Failed(arch, error)
    own = check_bundle(folder, data, args)
    trained, export, tta = report["train"], report["export"], report["tta"]
    shifted = report["ttt"]["mean_shifted"]
    int8 = report.get("quantize") or None
    # with int8 served, evaluation holds int8's figures: the goals read fp32's
    test = (int8["accuracy_fp32"] if int8 and int8.get("used_for_inference")
            else report["evaluation"]["mean_iou"])
    return Measured(
        arch=arch, parameters=trained["num_parameters"], epochs_run=trained["epochs_run"],
        train_seconds=trained["seconds"], pipeline_seconds=seconds,
        val_mean_iou=trained["val_mean_iou"], test_mean_iou=test,
        export_agreement=export["mask_agreement"],
        export_resolutions=export["resolutions_checked"], tta_plain=tta["mean_iou_plain"],
        tta_mean_iou=tta["mean_iou"], tta_cost_ratio=tta["cost_ratio"],
        ttt_source=shifted["mean_iou_source"], ttt_bn=shifted["mean_iou_bn"], int8=int8,
        **own)


# ----------------------------------------------------------------------------- printing


def print_figures(results: list[Measured]) -> None:
    print(f"\n{'arch':<27} {'params':>9} {'ep':>3} {'train s':>8} {'val mIoU':>8} "
          f"{'test mIoU':>9} {'eager ms@1':>10} {'ORT ms@1':>9} {'loop ms@1':>9} "
          f"{'graph ms@1':>10} {'TTA mIoU':>15} {'bn-TTT shifted':>15} {'int8 mIoU':>9}")
    for r in results:
        int8 = f"{r.int8['accuracy']:>9.4f}" if r.int8 else f"{'-':>9}"
        print(f"{r.arch:<27} {r.parameters:>9,} {r.epochs_run:>3} {r.train_seconds:>8.1f} "
              f"{r.val_mean_iou:>8.4f} {r.test_mean_iou:>9.4f} {r.eager_ms:>10.3f} "
              f"{r.ort_ms:>9.3f} {r.loop_ms:>9.3f} {r.graph_ms:>10.3f} "
              f"{r.tta_plain:.4f}->{r.tta_mean_iou:.4f} {r.ttt_source:.4f}->{r.ttt_bn:.4f} {int8}")


Row = tuple[str, str, str, bool | None]  # what, measured, goal, met (None: no goal)


def goal_rows(r: Measured, args: argparse.Namespace) -> list[Row]:
    """The goals of one arch, and the figures reported beside them without a goal."""
    goal = GOALS.get(r.arch)
    rows: list[Row] = [
        ("test mean IoU (fp32)", f"{r.test_mean_iou:.4f}", f"≥ {goal:.2f}" if goal else "-",
         None if goal is None else r.test_mean_iou >= goal)]
    limit = UNET_TRAIN_SECONDS if r.arch == "unet" else None
    rows.append(("training time", f"{r.train_seconds:.0f} s ({r.epochs_run} epochs)",
                 f"≤ {limit:.0f} s" if limit else "-",
                 None if limit is None else r.train_seconds <= limit))
    rows.append((f"export check, mask agreement at {' and '.join(r.export_resolutions)}",
                 f"{r.export_agreement:.6f}", f"≥ {MIN_AGREEMENT}",
                 r.export_agreement >= MIN_AGREEMENT))
    for size, share in r.agreement.items():
        rows.append((f"ONNX vs PyTorch mask agreement, test images at {size}", f"{share:.6f}",
                     f"≥ {MIN_AGREEMENT}", share >= MIN_AGREEMENT))
    ratio = r.eager_ms / r.ort_ms
    rows.append(("ORT fp32 / PyTorch eager at batch 1",
                 f"{ratio:.2f}x ({r.eager_ms:.3f} → {r.ort_ms:.3f} ms)",
                 f"≥ {ORT_OVER_EAGER:g}x", ratio >= ORT_OVER_EAGER))
    rows.append((f"{args.tta_transforms}-TTA test mean IoU change",
                 f"{r.tta_mean_iou - r.tta_plain:+.4f} ({r.tta_plain:.4f} → {r.tta_mean_iou:.4f},"
                 f" cost {r.tta_cost_ratio:.2f}x)", "-", None))
    rows.append(("TTA loop vs graph, mask agreement", f"{r.loop_agreement:.6f}",
                 f"≥ {MIN_AGREEMENT}", r.loop_agreement >= MIN_AGREEMENT))
    speed = r.loop_ms / r.graph_ms
    rows.append(("in-graph TTA / loop of sessions at batch 1",
                 f"{speed:.2f}x ({r.loop_ms:.3f} → {r.graph_ms:.3f} ms)",
                 f"≥ {GRAPH_OVER_LOOP:g}x", speed >= GRAPH_OVER_LOOP))
    gain = r.ttt_bn - r.ttt_source
    rows.append(("bn-TTT mean IoU gain, mean over the 3 shifts",
                 f"{100 * gain:+.1f} points ({r.ttt_source:.4f} → {r.ttt_bn:.4f})",
                 f"≥ +{100 * TTT_GAIN:.0f} points", gain >= TTT_GAIN))
    return rows + int8_rows(r.int8)


def int8_rows(q: dict | None) -> list[Row]:
    """int8 static against fp32 (the report's quantize section), reported without a goal."""
    if not q:
        return []
    served = "served" if q.get("used_for_inference") else "fp32 kept"
    return [("int8 static test mean IoU (vs fp32)",
             f"{q['accuracy']:.4f} ({q['accuracy'] - q['accuracy_fp32']:+.4f}), {served}", "-",
             None),
            (f"int8 / fp32 speed at batch {q['batch_size']} and at batch 1",
             f"{q['latency_ms_p50_fp32'] / q['latency_ms_p50']:.2f}x, "
             f"{q['latency_ms_p50_batch1_fp32'] / q['latency_ms_p50_batch1']:.2f}x", "-", None)]


def print_goals(results: list[Measured | Failed], args: argparse.Namespace) -> None:
    print(f"\ngoals ({args.canvases} canvases of {args.size}x{args.size}, {args.threads} "
          f"thread(s), timings p50 over turns at batch 1; shifts {SHIFTS} at severity 3):")
    print(f"  {'arch':<27} {'what':<56} {'measured':<38} {'goal':<12} met")
    for r in results:
        if isinstance(r, Failed):
            print(f"  {r.arch:<27} {r.error}")
            continue
        for what, value, goal, met in goal_rows(r, args):
            verdict = "-" if met is None else ("met" if met else "NOT met")
            print(f"  {r.arch:<27} {what:<56} {value:<38} {goal:<12} {verdict}")
    if not int8_built():
        print("  int8: not built for image_segmenter yet (pipeline.py refuses --quantize, exit 2)")


# ----------------------------------------------------------------------------- main


def write_canvases(count: int, size: int) -> Path:
    from ttc.tasks.segment.canvases import write_digit_canvases

    return write_digit_canvases(scratch_dir() / f"canvases_{count}_{size}", count, size, seed=0)


def run(args: argparse.Namespace, out: Path) -> None:
    started = time.perf_counter()
    data = write_canvases(args.canvases, args.size)
    print(f"data: {args.canvases} canvases of {args.size}x{args.size} "
          f"({time.perf_counter() - started:.1f} s to write); {args.epochs} epochs, one_cycle, "
          f"learning rate {args.learning_rate:g}, batch {args.batch_size}, {args.threads} "
          "thread(s)", flush=True)
    results = []
    for arch in args.archs.split(","):
        results.append(measure(arch, data, out, args))
        r = results[-1]
        print(f"{arch}: {r.error}" if isinstance(r, Failed) else
              f"{arch}: trained in {r.train_seconds:.1f} s (pipeline.py {r.pipeline_seconds:.1f}"
              f" s in all), test mean IoU {r.test_mean_iou:.4f}", flush=True)
    for line in LOG_REEXPORT:
        print(line, flush=True)
    (out / "figures.json").write_text(json.dumps([vars(r) for r in results], indent=1) + "\n")
    print_figures([r for r in results if isinstance(r, Measured)])
    print_goals(results, args)
    if any(isinstance(r, Failed) for r in results):
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--canvases", type=int, default=2000, help="digit canvases written")
    parser.add_argument("--size", type=int, default=64, help="the canvases' side in pixels")
    parser.add_argument("--epochs", type=int, default=18)
    parser.add_argument("--learning_rate", type=float, default=1e-2,
                        help="peak learning rate of the one-cycle schedule")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--archs", help=f"comma-separated --arch values (default: {DEFAULT_ARCHS};"
                        " with --quick unet)")
    parser.add_argument("--tta_transforms", default="hflip",
                        help="the TTA views (hflip, vflip, scale:F[,F...])")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch and ONNX Runtime threads, in training and timing")
    parser.add_argument("--runs", type=int, default=200, help="timed turns at batch 1")
    parser.add_argument("--images", type=int, default=64,
                        help="test images the batch-1 turns cycle through")
    parser.add_argument("--out", help=f"where the bundles go (default: {DEFAULT_OUT}; with "
                        "--quick a temporary folder)")
    parser.add_argument("--reexport", action="store_true",
                        help="do not train an arch whose bundle is already in --out: export it "
                        "again with this checkout's export.py and redo this script's checks "
                        "(the training figures stay the earlier run's)")
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.canvases, args.size, args.epochs, args.runs, args.images = 120, 24, 1, 3, 4
    args.archs = args.archs or ("unet" if args.quick else DEFAULT_ARCHS)
    quiet_single_thread(args.quick)
    if args.threads != 1:
        import torch

        torch.set_num_threads(args.threads)
    if args.out or not args.quick:
        run(args, REPO / (args.out or DEFAULT_OUT))
        return
    with tempfile.TemporaryDirectory(prefix="bench_segment_") as tmp:
        run(args, Path(tmp))


if __name__ == "__main__":
    main()
