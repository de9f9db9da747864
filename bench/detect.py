"""Object detection (issue 44) measured in one run: the detector trained by pipeline.py on
digit-box canvases, its bundle checked and timed here, one table of goals.

    python bench/detect.py [--canvases 4300] [--size 96] [--arch centernet] [--epochs 18]
                           [--learning_rate 4e-3]
                           [--lr_schedule one_cycle] [--batch_size 64] [--score_threshold 0.05]
                           [--tta_transforms scale:0.75,1.25] [--runs 200] [--out DIR] [--quick]

The data: --canvases canvases of --size pixels written once by
ttc.tasks.detect.canvases.write_yolo_canvases (YOLO layout: images/, labels/, classes.txt; 1 to 5
of scikit-learn's digits pasted at 16-40 px on noise, 10 classes; seed 0, the same bytes every
run), split 70/15/15 by pipeline.py (4,300 canvases: 3,010 to train, 645 to validate, 645 to
test). The detector is one `pipeline.py --model_type object_detector` run as a user would type
it, 1 thread (--num_threads 1: torch and ONNX Runtime); its report JSON gives the training time,
the test mAP@[.5:.95] and mAP@.5 (ONNX Runtime's detections, COCO's metrics) and the export
check. Then, on every test image and with 1 thread each:

  mAP gap     model.onnx's detections (ONNX Runtime) against the rebuilt PyTorch network's
              (model.pt through ttc.tasks.detect.nms.detect: the same decoding and torchvision's
              batched_nms), both scored by ttc.tasks.detect.metrics.detection_metrics
  identical   model.onnx at batch 1, 4 and 8 against PyTorch, at --size and 1.5x --size
              pixels: an image differs when its detections differ in number, or a box finds no
              partner of its class with IoU >= 0.99, or a score differs by more than 1e-4 (the
              issue's criterion; export.matched pairs them)
  ORT/eager   model.onnx against nms.detect at batch 1, both the full pipeline (network,
              decoding, NMS, padding), timed in turns (runtime.time_runners) on the same images

Where a detector takes them, the run adds --quantize static (the table gives int8's test mAP@.5
against fp32's from the report's quantize section; the mAP goals read fp32's either way), --ttt
true --eval_shift gaussian_noise,contrast,blur --shift_severity 3 (bn's mAP@.5 gain, mean over
the three) and --tta true --tta_transforms TRANSFORMS (the TTA graph's mAP change and cost);
a method pipeline.py refuses is listed as "not built yet", without a figure. The int8 rows come
once per weight range (issue 61): the pipeline's --int8_range auto, and quantize.py's other range
on a copy of the bundle (full: 8-bit weights; reduced: 7-bit, ONNX Runtime's reduce_range), each
with its test mAP against fp32's, its speed at --batch_size and at batch 1, and this CPU's int8
instructions (full range saturates on x86 CPUs without VNNI or AMX). A failed pipeline.py run is reported and the script exits 1. --quick: 120 canvases of
32 pixels, 1 epoch, a few timed turns, one TTA view (scale:1.25, unless --tta_transforms says
otherwise: the TTA graph's export and check cost about 10 s a view), the bundle in a temporary
folder; its figures mean nothing.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common import REPO, Config, add_quick_flag, quiet_single_thread, scratch_dir

DEFAULT_OUT = "runs/bench_detect"
CHECK_BATCH = 32  # images per run for the mAP figures (both sides)
BATCH_SIZES = (1, 4, 8)  # the batch sizes the graph's detections are compared at
MIN_IOU, SCORE_ATOL = 0.99, 1e-4  # the issue's: matched boxes, their scores
MAP50_GOAL, MAP_GOAL = 0.85, 0.55
TRAIN_SECONDS = 900.0
MAP_GAP = 0.002
ORT_OVER_EAGER = 2.0
NOT_BUILT = ("int8 (head and NMS in float) loses ≤ 1 mAP@.5 point, or is refused with the reason",
             "box-fusing TTA (hflip, multi-scale, WBF in the graph): the mAP change",
             "bn-TTT ≥ +10 mAP@.5 points, mean over 3 corruptions at severity 3")
SHIFTS = "gaussian_noise,contrast,blur"
TTA_TRANSFORMS = "scale:0.75,1.25"
QUICK_TTA_TRANSFORMS = "scale:1.25"  # --quick: one view, still a scale (resizing) one
INT8_MAP50_DROP = 0.01
TTT_GAIN = 0.10


@dataclass
class Measured:
    """The detector's figures: from its report JSON and from this script's own checks."""

    parameters: int
    epochs_run: int
    best_epoch: int
    train_seconds: float
    pipeline_seconds: float
    val_map: float
    test_map: float
    test_map50: float
    test_map75: float
    test_recall_100: float
    export: dict  # the report's export check: detections, min IoU, max score diff, sizes
    test_images: int
    map_onnx: float
    map50_onnx: float
    map_torch: float
    map50_torch: float
    differing: dict[str, int]  # "HxW batch B" → test images whose detections differ
    min_matched_iou: float
    max_score_diff: float
    eager_ms: float
    ort_ms: float
    quantize: dict | None = None  # the report's sections of the methods pipeline.py ran
    other_range: dict | None = None  # quantize.py's section with the range auto did not pick
    ttt: dict | None = None
    tta: dict | None = None


# ----------------------------------------------------------------------------- the pipeline run


def pipeline_command(data: Path, folder: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(REPO / "pipeline.py"), "--model_type", "object_detector",
            "--dataset_path", str(data), "--arch", args.arch, "--epochs", str(args.epochs),
            "--learning_rate", str(args.learning_rate), "--lr_schedule", args.lr_schedule,
            "--batch_size", str(args.batch_size), "--score_threshold", str(args.score_threshold),
            "--num_threads", str(args.threads), "--plots", "none", "--no_progress", "true",
            "--output_model", str(folder / "model.onnx"),
            "--report_json", str(folder / "report.json"), *method_flags(args)]


def method_flags(args: argparse.Namespace) -> list[str]:
    """int8, bn-TTT under the three shifts and TTA, each where a detector takes it."""
    flags = []
    if not refused("quantize"):
        flags += ["--quantize", "static"]
    if not refused("ttt"):
        flags += ["--ttt", "true", "--eval_shift", SHIFTS, "--shift_severity", "3"]
    if not refused("tta"):
        flags += ["--tta", "true", "--tta_transforms", args.tta_transforms]
    return flags


def train(data: Path, folder: Path, args: argparse.Namespace) -> tuple[dict | None, float, str]:
    """(the report JSON or None, the run's wall seconds, its error line or "")."""
    started = time.perf_counter()
    done = subprocess.run(pipeline_command(data, folder, args), capture_output=True, text=True,
                          cwd=REPO)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        return None, seconds, f"pipeline.py failed (exit {done.returncode}): {lines[-1]}"
    return json.loads((folder / "report.json").read_text()), seconds, ""


def quantize_other_range(folder: Path, data: Path, int8: dict, args: argparse.Namespace
                         ) -> dict | str:
    """quantize.py --int8_range with the range the pipeline's auto did not pick, on a copy of
    the bundle (the bundle keeps its own int8): its report's quantize section, or the error."""
    import shutil

    other = "full" if int8.get("reduce_range") else "reduced"
    copy = folder / f"int8_{other}"
    copy.mkdir(exist_ok=True)
    for path in folder.glob("model.*"):
        shutil.copy(path, copy / path.name)
    done = subprocess.run(
        [sys.executable, str(REPO / "quantize.py"), "--output_model", str(copy / "model.onnx"),
         "--dataset_path", str(data), "--quantize", "static", "--int8_range", other,
         "--batch_size", str(args.batch_size), "--num_threads", str(args.threads),
         "--no_progress", "true", "--report_json", str(copy / "report.json")],
        capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        return f"quantize.py --int8_range {other} failed (exit {done.returncode}): {lines[-1]}"
    return json.loads((copy / "report.json").read_text())["quantize"]


def refused(flag: str) -> bool:
    """Whether pipeline.py refuses --flag for a detector (exit 2)."""
    from ttc.tasks.detect import REFUSED_FLAGS

    return flag in REFUSED_FLAGS


# ----------------------------------------------------------------------------- own checks


def held_out_split(data: Path, manifest) -> tuple[np.ndarray, list[np.ndarray]]:
    """The test split pipeline.py evaluated: the same folder split by the same seed, decoded by
    the bundle's preprocessing."""
    from ttc.inputs.data import DataOptions, load_dataset

    config = Config(model_type="object_detector", dataset_path=str(data), no_progress=True)
    dataset = load_dataset(DataOptions.from_config(config),
                           preprocessing=manifest.preprocessing.spec, labels=manifest.labels,
                           splits=("test",))
    return dataset.test.x, list(dataset.test.y)


def in_batches(run, x: np.ndarray, size: int) -> list:
    """run(batch) → per image its detections, over every image, `size` images a run."""
    return [found for i in range(0, len(x), size) for found in run(x[i:i + size])]


def map_gap(session, net, nms, x: np.ndarray, y: list[np.ndarray], labels) -> dict:
    """mAP@[.5:.95] and mAP@.5 of ONNX Runtime's and of PyTorch's detections on the images."""
    from ttc.tasks.detect.evaluate import detection_runner
    from ttc.tasks.detect.export import eager_detections
    from ttc.tasks.detect.metrics import detection_metrics

    onnx = detection_metrics(in_batches(detection_runner(session), x, CHECK_BATCH), y, labels)
    torch_ = detection_metrics(in_batches(lambda b: eager_detections(net, b, nms), x,
                                          CHECK_BATCH), y, labels)
    return {"map_onnx": onnx["map"], "map50_onnx": onnx["map50"], "map_torch": torch_["map"],
            "map50_torch": torch_["map50"]}


def identical(session, net, nms, x: np.ndarray) -> dict:
    """Per size (--size and 1.5x) and batch size, the test images whose graph detections differ
    from PyTorch's (count, box IoU < MIN_IOU or score off by > SCORE_ATOL); the smallest matched
    IoU and the largest score difference over all."""
    from ttc.tasks.detect.evaluate import detection_runner
    from ttc.tasks.detect.export import eager_detections, matched
    from ttc.tasks.segment.export import resized, second_size

    run = detection_runner(session)
    height, width = x.shape[-2:]
    differing, low, worst = {}, 1.0, 0.0
    for size in ((height, width), second_size(height, width)):
        images = resized(x, size)
        expected = in_batches(lambda b: eager_detections(net, b, nms), images, CHECK_BATCH)
        for batch in BATCH_SIZES:
            pairs = [matched(g, e) for g, e in zip(in_batches(run, images, batch), expected)]
            found = [p for p in pairs if p is not None]
            low = min([low] + [p[0] for p in found])
            worst = max([worst] + [p[1] for p in found])
            differing[f"{size[0]}x{size[1]} batch {batch}"] = sum(
                p is None or p[0] < MIN_IOU or p[1] > SCORE_ATOL for p in pairs)
    return {"differing": differing, "min_matched_iou": low, "max_score_diff": worst}


def check_bundle(folder: Path, data: Path, args: argparse.Namespace) -> dict:
    """This script's own figures for the bundle (see the module's docstring)."""
    import torch

    from ttc.nets.models import load_weights
    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.serving.runtime import create_session, time_runners
    from ttc.tasks.detect.evaluate import OUTPUTS
    from ttc.tasks.detect.nms import detect
    from ttc.tasks.detect.training import NmsSettings

    paths = BundlePaths.from_model_path(folder / "model.onnx")
    manifest = read_manifest(paths)
    nms = NmsSettings.from_preprocessing(manifest.preprocessing.spec)
    x, y = held_out_split(data, manifest)
    session = create_session(str(paths.onnx), Config(num_threads=args.threads).cpu_runtime())
    net = load_weights(manifest, paths.weights, False).eval()
    figures = {"test_images": len(x), **map_gap(session, net, nms, x, y, manifest.labels),
               **identical(session, net, nms, x)}

    def eager(batch: np.ndarray):
        return detect(net, torch.from_numpy(batch), nms.iou_threshold, nms.score_threshold,
                      nms.max_detections)

    def ort(batch: np.ndarray):
        return session.run(OUTPUTS, {"image": batch})

    ones = [x[i:i + 1] for i in range(min(len(x), args.images))]
    speed = time_runners([eager, ort], ones, runs=args.runs,
                         min_seconds=0.0 if args.quick else 1.0)
    return {**figures, "eager_ms": speed.percentile_ms(0, 50), "ort_ms": speed.percentile_ms(1, 50)}


def measure(data: Path, out: Path, args: argparse.Namespace) -> Measured | str:
    """The figures, or the failed pipeline.py run's error line."""
    report, seconds, error = train(data, out, args)
    if report is None:
        return error
    own = check_bundle(out, data, args)
    trained, export, evaluation = report["train"], report["export"], report["evaluation"]
    int8 = report.get("quantize") or None
    if int8 and int8.get("used_for_inference"):  # evaluation holds int8's: the goals read fp32's
        evaluation = {**evaluation, "map": int8["accuracy_fp32"],
                      "map50": (int8.get("test_metrics") or {}).get("map50_fp32",
                                                                     evaluation["map50"])}
    other = quantize_other_range(out, data, int8, args) if int8 else None
    if isinstance(other, str):
        return other
    return Measured(quantize=int8, other_range=other, ttt=report.get("ttt"), tta=report.get("tta"),
        parameters=trained["num_parameters"], epochs_run=trained["epochs_run"],
        best_epoch=trained["best_epoch"], train_seconds=trained["seconds"],
        pipeline_seconds=seconds, val_map=trained["val_map"], test_map=evaluation["map"],
        test_map50=evaluation["map50"], test_map75=evaluation["map75"],
        test_recall_100=evaluation["recall_100"],
        export={k: export[k] for k in ("detections_checked", "min_matched_iou", "max_abs_diff",
                                       "count_mismatches", "resolutions_checked")},
        **own)


# ----------------------------------------------------------------------------- printing


def print_figures(r: Measured) -> None:
    print(f"\n{'params':>9} {'ep':>3} {'best':>4} {'train s':>8} {'val mAP':>8} {'test mAP':>8} "
          f"{'mAP@.5':>7} {'mAP@.75':>7} {'AR@100':>7} {'eager ms@1':>10} {'ORT ms@1':>9}")
    print(f"{r.parameters:>9,} {r.epochs_run:>3} {r.best_epoch:>4} {r.train_seconds:>8.1f} "
          f"{r.val_map:>8.4f} {r.test_map:>8.4f} {r.test_map50:>7.4f} {r.test_map75:>7.4f} "
          f"{r.test_recall_100:>7.4f} {r.eager_ms:>10.3f} {r.ort_ms:>9.3f}")


Row = tuple[str, str, str, bool | None]  # what, measured, goal, met (None: no figure)


def goal_rows(r: Measured) -> list[Row]:
    """The issue's goals, each with its figure and whether it is met."""
    e = r.export
    export_ok = (e["count_mismatches"] == 0 and e["min_matched_iou"] >= MIN_IOU
                 and e["max_abs_diff"] <= SCORE_ATOL)
    gap = max(abs(r.map_onnx - r.map_torch), abs(r.map50_onnx - r.map50_torch))
    checked = len(r.differing) * r.test_images
    differing = sum(r.differing.values())
    sizes = sorted({k.split()[0] for k in r.differing}, key=lambda s: int(s.split("x")[0]))
    ratio = r.eager_ms / r.ort_ms
    return [
        ("test mAP@.5", f"{r.test_map50:.4f}", f"≥ {MAP50_GOAL}", r.test_map50 >= MAP50_GOAL),
        ("test mAP@[.5:.95]", f"{r.test_map:.4f}", f"≥ {MAP_GOAL}", r.test_map >= MAP_GOAL),
        ("training time", f"{r.train_seconds:.0f} s ({r.epochs_run} epochs)",
         f"≤ {TRAIN_SECONDS:.0f} s", r.train_seconds <= TRAIN_SECONDS),
        (f"export check at {' and '.join(e['resolutions_checked'])}",
         f"{e['detections_checked']:,} dets, IoU ≥ {e['min_matched_iou']:.6f}, "
         f"Δscore ≤ {e['max_abs_diff']:.1e}", "same", export_ok),
        ("ONNX vs PyTorch gap, mAP@[.5:.95] and mAP@.5",
         f"{r.map_onnx - r.map_torch:+.5f}, {r.map50_onnx - r.map50_torch:+.5f}",
         f"≤ {MAP_GAP}", gap <= MAP_GAP),
        (f"images differing at batch {'/'.join(map(str, BATCH_SIZES))}, {' and '.join(sizes)}",
         f"{differing} of {checked:,} (IoU ≥ {r.min_matched_iou:.6f}, Δscore ≤ "
         f"{r.max_score_diff:.1e})", "0", differing == 0),
        ("ORT fp32 / PyTorch eager at batch 1, with NMS",
         f"{ratio:.2f}x ({r.eager_ms:.3f} → {r.ort_ms:.3f} ms)", f"≥ {ORT_OVER_EAGER:g}x",
         ratio >= ORT_OVER_EAGER)]


def method_rows(r: Measured) -> list[Row]:
    """int8, TTA and bn-TTT, from the report's sections (no row for a method not run)."""
    rows: list[Row] = []
    for q in (r.quantize, r.other_range):
        if q and q.get("test_metrics"):
            rows += int8_rows(q)
    t = r.tta
    if t and "map50" in t:
        rows.append((f"TTA ({t.get('transforms')}) test mAP@.5 and mAP@[.5:.95] change",
                     f"{t['map50'] - t['map50_plain']:+.4f}, {t['map'] - t['map_plain']:+.4f} "
                     f"(cost {t.get('cost_ratio', float('nan')):.2f}x)", "-", None))
    shifted = (r.ttt or {}).get("mean_shifted")
    if shifted:
        gain = shifted["map50_bn"] - shifted["map50_source"]
        rows.append(("bn-TTT mAP@.5 gain, mean over the 3 shifts",
                     f"{gain * 100:+.1f} points ({shifted['map50_source']:.4f} → "
                     f"{shifted['map50_bn']:.4f})", "≥ +10 points", gain >= TTT_GAIN))
    return rows


def int8_rows(q: dict) -> list[Row]:
    """One int8 graph's rows: its test mAP@.5 drop (the gate's verdict) and mAP@[.5:.95] drop,
    and its speed, named by its weight range."""
    weights = "7-bit (reduce_range)" if q.get("reduce_range") else "8-bit (full range)"
    metrics = q["test_metrics"]
    drop = metrics["map50_fp32"] - metrics["map50"]
    return [(f"int8 static {weights}: test mAP@.5 drop",
             f"{drop * 100:+.2f} points ({metrics['map50_fp32']:.4f} → {metrics['map50']:.4f}); "
             f"{'served' if q['used_for_inference'] else 'fp32 kept'}",
             "≤ 1 point", drop <= INT8_MAP50_DROP or not q["used_for_inference"]),
            (f"int8 static {weights}: test mAP@[.5:.95] drop",
             f"{(q['accuracy_fp32'] - q['accuracy']) * 100:+.2f} points "
             f"({q['accuracy_fp32']:.4f} → {q['accuracy']:.4f})", "-", None),
            ("  its speed over fp32 at batch size and at batch 1",
             f"{q['latency_ms_p50_fp32'] / q['latency_ms_p50']:.2f}x, "
             f"{q['latency_ms_p50_batch1_fp32'] / q['latency_ms_p50_batch1']:.2f}x "
             f"(batch {q['batch_size']})", "-", None)]


def print_goals(result: Measured | str, args: argparse.Namespace) -> None:
    print(f"\ngoals ({args.canvases} canvases of {args.size}x{args.size}, {args.threads} "
          f"thread(s), timings p50 over turns at batch 1):")
    print(f"  {'what':<58} {'measured':<50} {'goal':<9} met")
    cpu = ((result.quantize or {}).get("cpu") or {}) if isinstance(result, Measured) else {}
    if cpu.get("description"):
        print(f"  int8 timed on {cpu['description']}")
    if isinstance(result, str):
        print(f"  {result}")
    else:
        for what, value, goal, met in goal_rows(result) + method_rows(result):
            verdict = "-" if met is None else "met" if met else "NOT met"
            print(f"  {what:<58} {value:<50} {goal:<9} {verdict}")
    for what, flag in zip(NOT_BUILT, ("quantize", "tta", "ttt")):
        if refused(flag):
            print(f"  {what:<108} not built yet")


# ----------------------------------------------------------------------------- main


def write_canvases(count: int, size: int) -> Path:
    from ttc.tasks.detect.canvases import write_yolo_canvases

    return write_yolo_canvases(scratch_dir() / f"boxes_{count}_{size}", count, size, seed=0)


def run(args: argparse.Namespace, out: Path) -> None:
    started = time.perf_counter()
    data = write_canvases(args.canvases, args.size)
    print(f"data: {args.canvases} canvases of {args.size}x{args.size} "
          f"({time.perf_counter() - started:.1f} s to write); --arch {args.arch}, "
          f"{args.epochs} epochs, "
          f"{args.lr_schedule} schedule, learning rate {args.learning_rate:g}, batch "
          f"{args.batch_size}, score threshold {args.score_threshold:g}, {args.threads} "
          "thread(s)", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    result = measure(data, out, args)
    if isinstance(result, Measured):
        print(f"trained in {result.train_seconds:.1f} s (pipeline.py {result.pipeline_seconds:.1f}"
              f" s in all), test mAP {result.test_map:.4f}, mAP@.5 {result.test_map50:.4f}",
              flush=True)
        (out / "figures.json").write_text(json.dumps(vars(result), indent=1) + "\n")
        print_figures(result)
    print_goals(result, args)
    if isinstance(result, str):
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--canvases", type=int, default=4300, help="digit-box canvases written")
    parser.add_argument("--size", type=int, default=96, help="the canvases' side in pixels")
    parser.add_argument("--arch", default="centernet",
                        help="the detector (pipeline.py's --arch); the goals were set for ours, "
                        "e.g. --arch ssdlite320_mobilenet_v3_large --epochs 2 --batch_size 16 "
                        "--learning_rate 1e-3 --tta_transforms hflip for torchvision's")
    parser.add_argument("--epochs", type=int, default=18)
    parser.add_argument("--learning_rate", type=float, default=4e-3, help="peak learning rate")
    parser.add_argument("--lr_schedule", default="one_cycle", choices=("auto", "one_cycle"))
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--score_threshold", type=float, default=0.05,
                        help="the graph's NMS score threshold")
    parser.add_argument("--tta_transforms", default=TTA_TRANSFORMS,
                        help="the TTA views, where a detector takes --tta")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch and ONNX Runtime threads, in training and timing")
    parser.add_argument("--runs", type=int, default=200, help="timed turns at batch 1")
    parser.add_argument("--images", type=int, default=64,
                        help="test images the batch-1 turns cycle through")
    parser.add_argument("--out", help=f"where the bundle goes (default: {DEFAULT_OUT}; with "
                        "--quick a temporary folder)")
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.canvases, args.size, args.epochs, args.runs, args.images = 120, 32, 1, 3, 4
        if args.tta_transforms == TTA_TRANSFORMS:
            args.tta_transforms = QUICK_TTA_TRANSFORMS
    quiet_single_thread(args.quick)
    if args.threads != 1:
        import torch

        torch.set_num_threads(args.threads)
    if args.out or not args.quick:
        run(args, REPO / (args.out or DEFAULT_OUT))
        return
    with tempfile.TemporaryDirectory(prefix="bench_detect_") as tmp:
        run(args, Path(tmp))


if __name__ == "__main__":
    main()
