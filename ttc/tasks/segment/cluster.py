"""A segmenter's batch inference on a Ray cluster (`inference.py --input ... --engine ray`,
issue 43 item 6): predict.py's run, spread out.

This process checks the paths and lists the images (predict.checked_listing) before the cluster
starts, and cuts the list into chunks of --worker_batch_size images (whole --batch_size
batches). A pool of Ray Data actors, each holding one ONNX Runtime session made once, takes a
chunk at a time: it decodes the images, predicts them a --batch_size batch at a time and writes
their masks (and overlays) to the shared mask folder itself, atomically and under the same paths
as the local engine (predict.Predicting, the same code), and returns the chunk's summary rows.
This process writes those rows in input order through predict.write_summary: the same
temporary file moved into place at the end, the same error rows and report section, with the
`engine` section the classifiers' Ray runs have. The mask folder must be one the workers see
(a local cluster's are this machine's processes; a cluster of several machines needs shared
storage, as for the bundle and the input).

Ray itself is imported only here (through ttc/serving/cluster.py), and only for --engine ray.
"""
from __future__ import annotations

import dataclasses
import json
from copy import copy
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Generic, Iterator, Sequence, TypeVar

import numpy as np

from ttc.inputs.limits import LIMITS, Limits, use_limits
from ttc.serving.cluster import (EngineStats, FirstBatch, RayOptions, connect,
                                 ordered_data_context, stop_ray, unwrapped)
from ttc.tasks.segment.predict import (Listed, Predicting, Runner, SegmentBatchOptions,
                                       SummaryRow, batches, checked_listing, raise_for_errors,
                                       write_summary)
from utils import LOG, progress

RunnerFactory = Callable[[], Runner]  # picklable; run once on each worker
MAX_BLOCKS = 1024  # the chunks' table in at most this many blocks (one chunk per map call)
Tally = TypeVar("Tally")  # what a run's writer returns: its counts (images, errors)


# ----------------------------------------------------------------------------- chunks


def chunk_rows(listed: Sequence[Listed], size: int) -> list[dict]:
    """The listed images in chunks of `size`, one table row each: the chunk's images (id, file,
    mask name, reason it cannot be predicted) as JSON, which holds any file name (a name that is
    not valid UTF-8 keeps its escapes)."""
    return [{"listing": json.dumps([[item.id, str(item.path),
                                     None if item.name is None else item.name.as_posix(),
                                     item.error] for item in chunk])}
            for chunk in batches(listed, size)]


def listing_of(text: str) -> list[Listed]:
    """A chunk's images back from chunk_rows' JSON."""
    return [Listed(id, Path(path), None if name is None else Path(name), error)
            for id, path, name, error in json.loads(text)]


def rows_from(batch: dict) -> list[SummaryRow]:
    """A worker's output batch as summary rows (an error row has no size and no shares)."""
    return [SummaryRow(str(id), str(mask), None if height < 0 else int(height),
                       None if height < 0 else int(width),
                       None if error else np.asarray(shares, dtype=np.float64), str(error))
            for id, mask, height, width, shares, error in zip(
                batch["id"], batch["mask"], batch["height"], batch["width"], batch["shares"],
                batch["error"])]


def columns_of(rows: Sequence[SummaryRow], classes: int) -> dict:
    """Summary rows as a worker returns them: columns of equal length, -1 for an error row's
    height and width, zeros for its shares."""
    return {"id": np.array([r.id for r in rows], dtype=object),
            "mask": np.array([r.mask for r in rows], dtype=object),
            "height": np.array([-1 if r.height is None else r.height for r in rows], np.int64),
            "width": np.array([-1 if r.width is None else r.width for r in rows], np.int64),
            "shares": np.stack([np.zeros(classes) if r.shares is None else r.shares
                                for r in rows]).astype(np.float64),
            "error": np.array([r.error for r in rows], dtype=object)}


def counted(row_batches: Iterator[list], update: Callable[[int], object]) -> Iterator[list]:
    """The row batches, each one's images counted (the progress bar's images)."""
    for rows in row_batches:
        update(len(rows))
        yield rows


def predicted_chunks(predicting, batch: dict) -> list:
    """A worker's input batch (chunk_rows' tables) predicted by `predicting` (a segmenter's or
    a detector's predict.Predicting) a --batch_size batch at a time: each image's result, in
    order."""
    results: list = []
    for text in batch["listing"]:
        chunk = listing_of(str(text))
        for items in batches(chunk, predicting.options.batch_size):
            results += predicting.batch(items)
    return results


# ----------------------------------------------------------------------------- workers


class SegmentWorker:
    """A Ray actor: chunks of listed images in, their summary rows out, their masks (and
    overlays) written. One ONNX Runtime session (made by the factory, with intra-op threads =
    the actor's CPUs) lives as long as the actor."""

    def __init__(self, make_runner: RunnerFactory, options: SegmentBatchOptions,
                 preprocessing: dict, classes: int, limits: Limits | None = None) -> None:
        use_limits(limits)  # the driver's --max_* flags, in this worker process
        self.predicting = Predicting(options, preprocessing, classes, make_runner())

    def __call__(self, batch: dict) -> dict:
        return columns_of(predicted_chunks(self.predicting, batch), self.predicting.classes)


def on_workers(options: SegmentBatchOptions) -> SegmentBatchOptions:
    """The options as a worker takes them: every path absolute (a worker's working folder is
    not this process's), no progress bar, no errors file (this process writes it)."""
    return dataclasses.replace(options, input=options.input.absolute(),
                               output=options.output.absolute(),
                               mask_dir=options.mask_dir.absolute(), errors=None,
                               show_progress=False)


# ----------------------------------------------------------------------------- running


def predict_images_on_ray(options: SegmentBatchOptions, preprocessing: dict, labels: list[str],
                          make_runner: RunnerFactory, report: dict,
                          ray_options: RayOptions) -> dict:
    """predict.predict_images on `ray_options.workers` Ray actors, chunks of
    `ray_options.worker_batch_size` images each (a multiple of options.batch_size: the batches
    the graph sees are the local engine's); the report's `predictions` and `engine` sections.
    The paths are checked and the images listed before the cluster starts."""
    listed = checked_listing(options, labels)
    job = RayJob(SegmentWorker, (make_runner, on_workers(options), preprocessing, len(labels),
                                 copy(LIMITS)), rows_from,
                 lambda row_batches: write_summary(options, labels, row_batches, report)[0],
                 "segment", "masks")
    tally = run_on_ray(job, listed, options.show_progress, ray_options, report)
    raise_for_errors(options, tally)
    return report["predictions"]


@dataclass
class RayJob(Generic[Tally]):
    """What run_on_ray spreads out: the actor (its class and its constructor's arguments), what
    one of its output batches holds (`results_from`: the images' results), and `write`, which
    writes the results in input order and stores the report's `predictions` (the run's counts
    back: images, errors); `desc` the progress bar's, `results` what the log calls them."""

    worker: type
    worker_args: tuple
    results_from: Callable[[dict], list]
    write: Callable[[Iterator[list]], Tally]
    desc: str
    results: str


def run_on_ray(job: RayJob[Tally], listed: Sequence[Listed], show_progress: bool,
               ray_options: RayOptions, report: dict) -> Tally:
    """The listed images predicted by `job` on `ray_options.workers` Ray actors, chunks of
    `ray_options.worker_batch_size` images each (chunk_rows), and written by it in input order;
    the report's `engine` section beside its `predictions`. Returns what job.write returned."""
    listed = [dataclasses.replace(item, path=item.path.absolute()) for item in listed]
    chunks = chunk_rows(listed, ray_options.worker_batch_size)
    stream = None
    try:
        address, start_seconds = connect(ray_options)
        import ray.data

        ordered_data_context()
        # one chunk per map call (batch_size 1), whatever blocks the table is cut into; Ray
        # Data restarts a dead actor and retries its tasks, whose files are rewritten whole
        dataset = ray.data.from_items(chunks, override_num_blocks=min(len(chunks), MAX_BLOCKS))
        dataset = dataset.map_batches(
            job.worker, fn_constructor_args=job.worker_args, batch_size=1, batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=ray_options.workers),
            num_cpus=ray_options.threads, num_gpus=ray_options.gpus or None)
        timing = FirstBatch()
        stream = iter(dataset.iter_batches(batch_size=None, batch_format="numpy"))
        with progress(total=len(listed), desc=job.desc, enabled=show_progress) as bar:
            tally = job.write(timing.watch(counted(map(job.results_from, stream), bar.update)))
    except Exception as err:  # noqa: BLE001 - a worker's own error comes back wrapped by Ray
        raise unwrapped(err) from None
    finally:
        stop_ray(stream, local=ray_options.address is None)
    section = report["predictions"]
    report["engine"] = EngineStats(
        "ray", address, ray_options.workers, ray_options.threads, ray_options.worker_batch_size,
        round(start_seconds, 3), timing.seconds, tally.images, tally.errors,
        section["images_per_second"], section["seconds"]).report_section()
    LOG.info("ray: %d workers, cluster start %.1f s, first %s after %.1f s",
             ray_options.workers, start_seconds, job.results, timing.seconds or 0.0)
    return tally
