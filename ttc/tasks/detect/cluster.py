"""A detector's batch inference on a Ray cluster (`inference.py --input ... --engine ray`,
issue 44 item 7): predict.py's run, spread out as the segmenter's is (ttc/tasks/segment/
cluster.py, whose chunks, their JSON and its run_on_ray this reuses).

This process checks the paths and lists the images (predict.checked_listing) before the cluster
starts, and cuts the list into chunks of --worker_batch_size images (whole --batch_size
batches). A pool of Ray Data actors, each holding one ONNX Runtime session made once, takes a
chunk at a time: it decodes the images, predicts them a --batch_size batch at a time, scales
their boxes back to each image's size and writes their overlays (with --overlay true) itself,
atomically and under the same paths as the local engine (predict.Predicting, the same code),
and returns each image's detections. This process writes them in input order through
predict.write_detections: the same temporary files moved into place at the end, the same rows
or COCO JSON byte for byte (a box's float64 values travel as JSON, which gives each back
exactly), the same error rows and report section, with the `engine` section the classifiers'
Ray runs have. The overlay folder must be one the workers see (a local cluster's are this
machine's processes; a cluster of several machines needs shared storage, as for the bundle and
the input).

Ray itself is imported only here (through ttc/serving/cluster.py), and only for --engine ray.
"""
from __future__ import annotations

import dataclasses
import json
from copy import copy
from typing import Callable, Sequence

import numpy as np

from ttc.inputs.limits import LIMITS, Limits, use_limits
from ttc.serving.cluster import RayOptions
from ttc.tasks.detect.evaluate import DetectionRunner
from ttc.tasks.detect.predict import (DetectBatchOptions, DetectRun, ImageDetections, Predicting,
                                      checked_listing, raise_for_errors, write_detections)
from ttc.tasks.segment.cluster import RayJob, predicted_chunks, run_on_ray

RunnerFactory = Callable[[], DetectionRunner]  # picklable; run once on each worker


# ----------------------------------------------------------------------------- results


def columns_of(results: Sequence[ImageDetections]) -> dict:
    """Images' detections as a worker returns them: columns of equal length, -1 for an error
    row's height and width, and each image's boxes, scores and class indices as one JSON text
    (float64 values written by repr, read back to the same bits)."""
    return {"id": np.array([r.id for r in results], dtype=object),
            "height": np.array([-1 if r.height is None else r.height for r in results],
                               np.int64),
            "width": np.array([-1 if r.width is None else r.width for r in results], np.int64),
            "detections": np.array([json.dumps([np.asarray(r.boxes, np.float64).tolist(),
                                                np.asarray(r.scores, np.float64).tolist(),
                                                np.asarray(r.classes, np.int64).tolist()])
                                    for r in results], dtype=object),
            "error": np.array([r.error for r in results], dtype=object)}


def results_from(batch: dict) -> list[ImageDetections]:
    """A worker's output batch as the images' detections (an error row has no size, no box)."""
    results = []
    for id, height, width, text, error in zip(batch["id"], batch["height"], batch["width"],
                                              batch["detections"], batch["error"]):
        if error:
            results.append(ImageDetections(str(id), error=str(error)))
            continue
        boxes, scores, classes = json.loads(str(text))
        results.append(ImageDetections(
            str(id), int(height), int(width), np.array(boxes, np.float64).reshape(-1, 4),
            np.array(scores, np.float64), np.array(classes, np.int64)))
    return results


# ----------------------------------------------------------------------------- workers


class DetectWorker:
    """A Ray actor: chunks of listed images in, their detections out, their overlays written.
    One ONNX Runtime session (made by the factory, with intra-op threads = the actor's CPUs)
    lives as long as the actor."""

    def __init__(self, make_runner: RunnerFactory, options: DetectBatchOptions,
                 preprocessing: dict, labels: list[str], limits: Limits | None = None) -> None:
        use_limits(limits)  # the driver's --max_* flags, in this worker process
        self.predicting = Predicting(options, preprocessing, labels, make_runner())

    def __call__(self, batch: dict) -> dict:
        return columns_of(predicted_chunks(self.predicting, batch))


def on_workers(options: DetectBatchOptions) -> DetectBatchOptions:
    """The options as a worker takes them: every path absolute (a worker's working folder is
    not this process's; the overlays' folder follows --output), no progress bar, no errors
    file (this process writes it)."""
    return dataclasses.replace(options, input=options.input.absolute(),
                               output=options.output.absolute(), errors=None,
                               show_progress=False)


# ----------------------------------------------------------------------------- running


def predict_detections_on_ray(options: DetectBatchOptions, preprocessing: dict,
                              labels: list[str], make_runner: RunnerFactory, report: dict,
                              ray_options: RayOptions) -> DetectRun:
    """predict.predict_detections_input on Ray actors, as the segmenter's run is spread
    (segment/cluster.py's run_on_ray: chunks of whole --batch_size batches; the report's
    `predictions` and `engine` sections), its paths checked before the cluster starts."""
    listed = checked_listing(options, labels)
    job = RayJob(DetectWorker, (make_runner, on_workers(options), preprocessing, list(labels),
                                copy(LIMITS)), results_from,
                 lambda result_batches: write_detections(options, labels, result_batches, report),
                 "detect", "detections")
    tally = run_on_ray(job, listed, options.show_progress, ray_options, report)
    raise_for_errors(options, tally)
    return tally
