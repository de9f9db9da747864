"""torchvision's two small detectors that issue 44 names, trained from scratch on bench/detect.py's
digit-box canvases under the same 15-minute CPU budget, scored by the same COCO metrics against
the same goals: the measurement behind choosing our own CenterNet (pipeline.py's detector) or one
of torchvision's.

    python bench/detect_torchvision.py [--archs ARCH[,ARCH]] [--canvases 4300] [--size 96]
                                       [--budget_s 900] [--learning_rate 1e-3] [--batch_size 0]
                                       [--size_override] [--runs 50] [--out FILE.json] [--quick]

ARCH: ssdlite320_mobilenet_v3_large, fasterrcnn_mobilenet_v3_large_320_fpn (default: both, one
after the other). The data: bench/detect.py's, exactly. --canvases canvases of --size pixels
are written by ttc.tasks.detect.canvases.write_yolo_canvases (seed 0) to a scratch folder and
read back by ttc.inputs.data.load_dataset as pipeline.py reads them (the same seeded 70/15/15 cut
and decoding: 4,300 canvases give 3,010 to train and 645 to test; the validation split is not
used). Each gray canvas goes to the networks as 3 equal channels in [0, 1]; class k is label
k + 1 (0 is torchvision's background), so num_classes=11.

Each arch is torchvision.models.detection.ARCH(weights=None, weights_backbone=None,
num_classes=11): no pretrained weights anywhere (torchvision then trains every backbone layer
with plain BatchNorm). Its post-processing keeps scores >= 0.05 and at most 100 detections per
image, as pipeline.py's detector is scored (ssdlite: score_thresh 0.05 and detections_per_img
100 in place of its 0.001 and 300; faster R-CNN: box_score_thresh and box_detections_per_img,
its defaults). The input is what torchvision builds: both resize the 96-px canvases to 320 px inside
the model; --size_override sets model.transform to --size instead (min_size, max_size and
ssdlite's fixed_size), the anchors following the image size as torchvision computes them.

The recipe, one for both, from scratch: AdamW (learning rate --learning_rate, weight decay
1e-4), the learning rate sized to the wall-clock budget rather than to a count of epochs (a
linear warm-up over the first 5% of --budget_s, then a cosine to 0 at --budget_s: no epoch count
has to be guessed, and faster R-CNN may not finish one epoch), gradient norm clipped at 10, a
seeded reshuffle each epoch, no augmentation; batch 16 for ssdlite and 8 for faster R-CNN
(--batch_size 0; a step of faster R-CNN at 320 px costs about 0.8 s an image on 1 thread), 1
torch thread (bench/common.py quiet_single_thread). Training stops before the step that would
pass --budget_s (the previous step's time predicts it); the clock counts the training steps
only (batch assembly, forward, backward, update), not data writing, evaluation or timing.

The figures, per arch: parameters; train s (the training clock); epochs completed (fractional:
images seen / training images); s/epoch (train s / epochs); the mean loss of the last 20 steps;
test mAP@[.5:.95], mAP@.5, mAP@.75 and AR@100 of the final weights on every test canvas
(ttc.tasks.detect.metrics.detection_metrics, COCO's own), evaluated once, after training
(an evaluation of 645 canvases costs faster R-CNN minutes, which would come out of its budget);
and eager latency at batch 1: the median ms of --runs calls of the model in eval mode on one
test canvas (3 x 96 x 96, its resize and post-processing inside), 1 thread. The goals table
reads bench/detect.py's goals: mAP@.5 >= 0.85, mAP@[.5:.95] >= 0.55, training <= 900 s. The last
line is the figures as one JSON object (also written to --out). Run two archs as two processes
(--archs one each) to train them side by side, each on its own core. --quick: 60 canvases of
64 px run at 64 px (--size_override: the same models and code at a 25th of the pixels), one
training step each, 3 timed calls; its figures mean nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from common import Config, add_quick_flag, quiet_single_thread, scratch_dir

ARCHS = ("ssdlite320_mobilenet_v3_large", "fasterrcnn_mobilenet_v3_large_320_fpn")
BATCH = {"ssdlite320_mobilenet_v3_large": 16, "fasterrcnn_mobilenet_v3_large_320_fpn": 8}
POSTPROCESS = {  # scores >= 0.05, at most 100 detections an image: how pipeline.py is scored
    "ssdlite320_mobilenet_v3_large": {"score_thresh": 0.05, "detections_per_img": 100},
    "fasterrcnn_mobilenet_v3_large_320_fpn": {"box_score_thresh": 0.05,
                                              "box_detections_per_img": 100}}
NUM_CLASSES = 11  # 10 digits + torchvision's background (label 0)
MAP50_GOAL, MAP_GOAL, TRAIN_SECONDS = 0.85, 0.55, 900.0  # bench/detect.py's goals
WEIGHT_DECAY, WARMUP, CLIP_NORM = 1e-4, 0.05, 10.0
LOSS_WINDOW = 20  # steps the final loss is averaged over
LOG_EVERY = 20  # steps between progress lines
EVAL_BATCH = 16


@dataclass
class Canvases:
    """The train and test splits: (N, 1, H, W) float32 in [0, 1], per image (k, 5) boxes."""

    train_x: np.ndarray
    train_y: list[np.ndarray]
    test_x: np.ndarray
    test_y: list[np.ndarray]
    labels: list[str]


@dataclass
class Trained:
    """What training one arch gives besides its weights."""

    steps: int
    images_seen: int
    train_seconds: float
    final_loss: float
    final_parts: dict[str, float]  # the loss's parts, means over the last LOSS_WINDOW steps


@dataclass
class Result:
    """One arch's figures (see the module's docstring)."""

    arch: str
    input_px: int
    parameters: int
    batch_size: int
    steps: int
    epochs: float
    train_seconds: float
    seconds_per_epoch: float
    final_loss: float
    final_parts: dict[str, float]
    test_map: float
    test_map50: float
    test_map75: float
    test_recall_100: float
    detections: int
    eval_seconds: float
    latency_ms: float


# ----------------------------------------------------------------------------- data


def load_canvases(count: int, size: int) -> Canvases:
    """bench/detect.py's canvases, split and decoded as pipeline.py does (the seeded cut)."""
    from ttc.inputs.data import DataOptions, load_dataset
    from ttc.tasks.detect.canvases import write_yolo_canvases

    folder = write_yolo_canvases(scratch_dir() / f"boxes_{count}_{size}", count, size, seed=0)
    config = Config(model_type="object_detector", dataset_path=str(folder), no_progress=True)
    dataset = load_dataset(DataOptions.from_config(config), splits=("train", "test"))
    return Canvases(dataset.train.x, list(dataset.train.y), dataset.test.x, list(dataset.test.y),
                    list(dataset.labels))


def as_images(x: np.ndarray) -> list:
    """(B, 1, H, W) gray → torchvision's list of (3, H, W) tensors."""
    import torch

    return [torch.from_numpy(np.ascontiguousarray(image)).expand(3, -1, -1) for image in x]


def as_targets(y: list[np.ndarray]) -> list[dict]:
    """(k, 5) [class, x1, y1, x2, y2] → torchvision's {boxes, labels}, labels shifted by 1."""
    import torch

    return [{"boxes": torch.from_numpy(np.ascontiguousarray(b[:, 1:5], dtype=np.float32)),
             "labels": torch.from_numpy(b[:, 0].astype(np.int64) + 1)} for b in y]


# ----------------------------------------------------------------------------- model, training


def build(arch: str, size_override: int | None):
    """torchvision's detector from scratch; with size_override its transform works at that
    side instead of resizing to 320."""
    import torch
    from torchvision.models import detection

    torch.manual_seed(0)
    model = getattr(detection, arch)(weights=None, weights_backbone=None,
                                     num_classes=NUM_CLASSES, **POSTPROCESS[arch])
    if size_override:
        model.transform.min_size = (size_override,)
        model.transform.max_size = size_override
        if getattr(model.transform, "fixed_size", None) is not None:
            model.transform.fixed_size = (size_override, size_override)
    return model


def lr_factor(elapsed: float, budget: float) -> float:
    """Linear warm-up over the first WARMUP of the budget, then a cosine to 0 at its end."""
    t = min(1.0, elapsed / budget)
    if t < WARMUP:
        return max(t / WARMUP, 0.01)
    return 0.5 * (1.0 + math.cos(math.pi * (t - WARMUP) / (1.0 - WARMUP)))


def step(model, optimizer, x: np.ndarray, y: list[np.ndarray]) -> dict[str, float]:
    """One update; the loss's parts as floats."""
    import torch

    parts = model(as_images(x), as_targets(y))
    loss = sum(parts.values())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
    optimizer.step()
    return {name: float(value.detach()) for name, value in parts.items()}


def train(model, data: Canvases, batch: int, lr: float, budget: float, tag: str) -> Trained:
    """Train until the next step would pass `budget` seconds of training steps."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    rng = np.random.default_rng(0)
    model.train()
    history: list[dict[str, float]] = []
    spent, last, seen = 0.0, 0.0, 0
    while spent + last <= budget:
        order = rng.permutation(len(data.train_x))
        for start in range(0, len(order), batch):
            if spent + last > budget:
                break
            chosen = order[start:start + batch]
            for group in optimizer.param_groups:
                group["lr"] = lr * lr_factor(spent, budget)
            began = time.perf_counter()
            history.append(step(model, optimizer, data.train_x[chosen],
                                [data.train_y[i] for i in chosen]))
            last = time.perf_counter() - began
            spent += last
            seen += len(chosen)
            log_progress(tag, history, spent, seen / len(data.train_x), optimizer)
    tail = history[-LOSS_WINDOW:]
    parts = {k: float(np.mean([h[k] for h in tail])) for k in tail[0]} if tail else {}
    return Trained(len(history), seen, spent, float(sum(parts.values())), parts)


def log_progress(tag: str, history: list[dict[str, float]], spent: float, epochs: float,
                 optimizer) -> None:
    if len(history) % LOG_EVERY == 0 or len(history) == 1:
        loss = np.mean([sum(h.values()) for h in history[-LOG_EVERY:]])
        print(f"  {tag} step {len(history):>5} {spent:>7.1f} s  epoch {epochs:5.2f}  "
              f"loss {loss:.4f}  lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)


# ----------------------------------------------------------------------------- evaluation


def predict(model, x: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per image (boxes xyxy, scores, class index) in the canvas' pixels."""
    import torch

    model.eval()
    found = []
    with torch.inference_mode():
        for start in range(0, len(x), EVAL_BATCH):
            for out in model(as_images(x[start:start + EVAL_BATCH])):
                found.append((out["boxes"].numpy().astype(np.float32),
                              out["scores"].numpy().astype(np.float32),
                              out["labels"].numpy().astype(np.int64) - 1))
    return found


def latency_ms(model, x: np.ndarray, runs: int) -> float:
    """Median ms of one eager call at batch 1 (eval mode, resize and post-processing inside)."""
    import torch

    model.eval()
    images = as_images(x[:1])
    times = []
    with torch.inference_mode():
        for turn in range(runs + 3):
            began = time.perf_counter()
            model(images)
            if turn >= 3:
                times.append(time.perf_counter() - began)
    return float(np.median(times) * 1000.0)


def measure(arch: str, data: Canvases, args: argparse.Namespace) -> Result:
    """Build, train within the budget, evaluate on the test split, time at batch 1."""
    from ttc.tasks.detect.metrics import detection_metrics

    override = args.size if args.size_override else None
    model = build(arch, override)
    batch = args.batch_size or BATCH[arch]
    params = sum(p.numel() for p in model.parameters())
    print(f"{arch}: {params:,} parameters, input {override or 320} px, batch {batch}, "
          f"budget {args.budget_s:g} s", flush=True)
    trained = train(model, data, batch, args.learning_rate, args.budget_s, arch.split("_")[0])
    began = time.perf_counter()
    metrics = detection_metrics(predict(model, data.test_x), data.test_y, data.labels)
    eval_seconds = time.perf_counter() - began
    epochs = trained.images_seen / len(data.train_x)
    result = Result(arch=arch, input_px=override or 320, parameters=params, batch_size=batch,
                    steps=trained.steps, epochs=epochs, train_seconds=trained.train_seconds,
                    seconds_per_epoch=trained.train_seconds / max(epochs, 1e-9),
                    final_loss=trained.final_loss, final_parts=trained.final_parts,
                    test_map=metrics["map"], test_map50=metrics["map50"],
                    test_map75=metrics["map75"], test_recall_100=metrics["recall_100"],
                    detections=metrics["detections"], eval_seconds=eval_seconds,
                    latency_ms=latency_ms(model, data.test_x, args.runs))
    print(f"{arch}: trained {result.train_seconds:.1f} s ({epochs:.2f} epochs, "
          f"{trained.steps} steps), final loss {trained.final_loss:.4f}, test mAP "
          f"{result.test_map:.4f}, mAP@.5 {result.test_map50:.4f} (evaluated in "
          f"{eval_seconds:.1f} s)", flush=True)
    return result


# ----------------------------------------------------------------------------- printing


def print_figures(results: list[Result]) -> None:
    print(f"\n{'arch':<38} {'px':>4} {'params':>11} {'train s':>8} {'epochs':>6} "
          f"{'s/epoch':>8} {'loss':>7} {'test mAP':>8} {'mAP@.5':>7} {'mAP@.75':>7} "
          f"{'AR@100':>7} {'ms@1':>8}")
    for r in results:
        print(f"{r.arch:<38} {r.input_px:>4} {r.parameters:>11,} {r.train_seconds:>8.1f} "
              f"{r.epochs:>6.2f} {r.seconds_per_epoch:>8.1f} {r.final_loss:>7.4f} "
              f"{r.test_map:>8.4f} {r.test_map50:>7.4f} {r.test_map75:>7.4f} "
              f"{r.test_recall_100:>7.4f} {r.latency_ms:>8.2f}")


def print_goals(results: list[Result], args: argparse.Namespace) -> None:
    print(f"\ngoals ({args.canvases} canvases of {args.size}x{args.size}, 1 thread, "
          f"{args.budget_s:g} s budget):")
    for r in results:
        rows = [("test mAP@.5", f"{r.test_map50:.4f}", f"≥ {MAP50_GOAL}",
                 r.test_map50 >= MAP50_GOAL),
                ("test mAP@[.5:.95]", f"{r.test_map:.4f}", f"≥ {MAP_GOAL}",
                 r.test_map >= MAP_GOAL),
                ("training time", f"{r.train_seconds:.0f} s ({r.epochs:.2f} epochs)",
                 f"≤ {TRAIN_SECONDS:.0f} s", r.train_seconds <= TRAIN_SECONDS)]
        for what, value, goal, met in rows:
            print(f"  {r.arch:<38} {what:<18} {value:<24} {goal:<8} "
                  f"{'goal met' if met else 'goal NOT met'}")
        everything = all(row[3] for row in rows)
        print(f"  {r.arch:<38} {'all three':<18} {'':<24} {'':<8} "
              f"{'goal met' if everything else 'goal NOT met'}")


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default=",".join(ARCHS),
                        help=f"comma-separated, of {', '.join(ARCHS)}")
    parser.add_argument("--canvases", type=int, default=4300, help="digit-box canvases written")
    parser.add_argument("--size", type=int, default=96, help="the canvases' side in pixels")
    parser.add_argument("--budget_s", type=float, default=TRAIN_SECONDS,
                        help="seconds of training steps per arch")
    parser.add_argument("--learning_rate", type=float, default=1e-3, help="AdamW's peak")
    parser.add_argument("--batch_size", type=int, default=0,
                        help="0: 16 for ssdlite, 8 for faster R-CNN")
    parser.add_argument("--size_override", action="store_true",
                        help="run the models at --size pixels instead of their 320")
    parser.add_argument("--runs", type=int, default=50, help="timed eager calls at batch 1")
    parser.add_argument("--out", help="write the figures as JSON here")
    add_quick_flag(parser)
    args = parser.parse_args()
    unknown = [a for a in args.archs.split(",") if a not in ARCHS]
    if unknown:
        parser.error(f"unknown arch {unknown[0]}; choose from {', '.join(ARCHS)}")
    if args.quick:
        # a budget below any step's time: exactly one step (the loop always takes the first)
        args.canvases, args.size, args.budget_s, args.runs = 60, 64, 0.01, 3
        args.size_override = True
    return args


def main() -> None:
    args = parse_args()
    quiet_single_thread()
    load_start = os.getloadavg()
    started = time.perf_counter()
    data = load_canvases(args.canvases, args.size)
    print(f"data: {args.canvases} canvases of {args.size}x{args.size}: {len(data.train_x)} "
          f"train, {len(data.test_x)} test ({time.perf_counter() - started:.1f} s); load "
          f"average {load_start[0]:.2f}", flush=True)
    results = [measure(arch, data, args) for arch in args.archs.split(",")]
    print_figures(results)
    print_goals(results, args)
    figures = {"canvases": args.canvases, "size": args.size, "budget_s": args.budget_s,
               "learning_rate": args.learning_rate, "load_average_start": load_start[0],
               "load_average_end": os.getloadavg()[0],
               "results": [asdict(r) for r in results]}
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
