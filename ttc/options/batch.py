"""Batch inference's flags (inference.py --input): where predictions go, how the input is
chunked, and the engine: this process, or Ray Data workers on a cluster."""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ttc.options.fields import bad, opt, parse_bool, positive
from utils import ConfigError

ENGINES = ("local", "ray")
OUTPUT_FORMATS = (".csv", ".jsonl", ".parquet")
DETECTION_FORMATS = ("rows", "coco")  # --output_format: an object_detector's output
RAY_FLAGS = ("ray_address", "num_workers", "worker_batch_size")
TRAINING_ENGINE = ("where the network trains: local (this process) or ray (Ray Train workers "
                   "under DistributedDataParallel on a cluster; a candidate search's "
                   "candidates as parallel Ray Tune trials; docs/distributed.md)")
TRAINING_WORKERS = ("--engine ray: Ray Train workers, each a process of --num_threads threads "
                    "(the CPUs it reserves) training its share of every --batch_size batch "
                    "(default 2, or 1 where a local cluster cannot hold 2); with a candidate "
                    "search, the most trials run at once (default: as many as the cluster "
                    "holds), each one process")
RAY_ADDRESS_HINT = "expected host:port, auto or local (e.g. 10.0.0.5:6379, the head node's port)"


@dataclass
class BatchFlags:
    input: str | None = opt(None, "inference.py: predict new data instead of evaluating the test "
                            "split: an image file, a folder of images (recursive), a "
                            "CSV/TSV/JSON/JSONL/Parquet table, or - for one text per line on "
                            "stdin",
                            "batch", metavar="INPUT", scripts="I")
    output: str | None = opt(None, "where --input's predictions go: .csv, .jsonl or .parquet "
                             "(written to a temporary file, moved into place at the end; "
                             "--output_format coco: .json)",
                             "batch",
                             metavar="PATH", scripts="I")
    errors: str | None = opt(None, "list the rows that could not be predicted (id, reason) in "
                             "this CSV", "batch", metavar="PATH", scripts="I")
    allow_errors: bool = opt(False, "exit 0 even when some rows could not be predicted",
                             "batch", type=parse_bool, metavar="BOOL", scripts="I")
    mask_dir: str | None = opt(None, "image_segmenter --input: the folder of the mask PNGs, "
                               "one per image with its path under --input (default: beside "
                               "--output, OUTPUT-STEM_masks)", "batch", metavar="DIR",
                               scripts="I")
    overlay: bool = opt(False, "image_segmenter --input: also write each image with its mask "
                        "overlaid in colour (beside the masks, OUTPUT-STEM_overlays); "
                        "object_detector: with its boxes drawn (beside --output, "
                        "OUTPUT-STEM_overlays)", "batch",
                        type=parse_bool, metavar="BOOL", scripts="I")
    output_format: str = opt("rows", "object_detector --input: rows (one per box: image, label, "
                             "class_index, score, x1, y1, x2, y2 in the image's own pixels, in "
                             "--output .csv, .jsonl or .parquet) or coco (a COCO results JSON "
                             "list at --output .json, with its images' ids and file names in "
                             "OUTPUT-STEM_images.json)", "batch", choices=DETECTION_FORMATS,
                             scripts="I")
    min_score: float = opt(0.0, "object_detector --input: write only the boxes scored at least "
                           "this (the graph's --score_threshold, fixed at export, dropped the "
                           "lower ones already)", "batch", type=float, metavar="SCORE",
                           scripts="I")
    id_column: str | None = opt(None, "a table --input's column that identifies its rows (a "
                                "name or 0-based position), written to --output under its own "
                                "name after the row number; default: a column named like id, "
                                "uid, key or path (an image table's path column)", "batch",
                                metavar="COLUMN", scripts="I")
    top_k: int = opt(1, "how many top classes (label, probability) each prediction row lists",
                     "batch", type=int, metavar="K", scripts="IS")
    chunk_rows: int = opt(4096, "rows read, encoded and predicted at a time (memory stays flat "
                          "whatever the input's size)", "batch", type=int, metavar="N",
                              scripts="I")
    engine: str = opt("local", "where --input is predicted: local (this process) or ray (Ray "
                      "Data workers on a cluster; docs/deploy.md, Ray)", "batch",
                      choices=ENGINES, scripts="PTIS", help_for={
        "S": "where the server runs: local (this process, on uvicorn) or ray (a Ray Serve "
             "deployment of --num_replicas replicas; docs/deploy.md)",
        "P": TRAINING_ENGINE, "T": TRAINING_ENGINE})
    ray_address: str | None = opt(None, "--engine ray: the cluster to join (host:port of its "
                                  "head node; auto: the one `ray start` runs here); default (or "
                                  "local): start a local one of this machine's CPUs for the run",
                                  "batch", metavar="ADDRESS", scripts="PTIS")
    num_workers: int | None = opt(None, "--engine ray: workers, each one ONNX Runtime session "
                                  "with --num_threads threads, which are the CPUs it reserves "
                                  "(default 2, or 1 where a local cluster cannot hold 2)",
                                  "batch", type=int, metavar="N", scripts="PTI",
                                  help_for={"P": TRAINING_WORKERS, "T": TRAINING_WORKERS})
    worker_batch_size: int | None = opt(None, "--engine ray: rows a worker reads, encodes and "
                                        "predicts at a time (default: --chunk_rows; a "
                                        "segmenter's: --batch_size images)", "batch",
                                        type=int, metavar="N", scripts="I")

    def check_batch(self, threads: Callable[[], int], profile: bool, online_ttt: bool,
                    serving: bool = False) -> None:
        """--input, --output and the engine. `threads` (a Ray worker's ONNX Runtime threads) is
        asked only when a local cluster must hold the workers, so that a bad --ep is reported
        by the runtime checks, after these; `profile` and `online_ttt` are refused on Ray."""
        positive("top_k", self.top_k)
        positive("chunk_rows", self.chunk_rows)
        if not 0 <= self.min_score <= 1:
            bad("min_score", self.min_score, "use a value from 0 to 1")
        coco = self.output_format == "coco"
        if self.output and Path(self.output).suffix.lower() not in (
                (".json",) if coco else OUTPUT_FORMATS):
            bad("output", self.output, "--output_format coco writes a COCO results JSON: give "
                "a path ending in .json" if coco else
                "give a path ending in .csv, .jsonl or .parquet" + (
                    " (.json is an object_detector's --output_format coco)"
                    if Path(self.output).suffix.lower() == ".json" else ""))
        if self.input and not self.output:
            raise ConfigError("--input needs --output", "add --output preds.csv")
        if not serving:  # serve.py checks its engine itself (ServeFlags.check_serve)
            self._check_engine(threads, profile, online_ttt)

    def input_outputs(self, segmenter: bool = False
                      ) -> tuple[dict[str, Path], dict[str, Path]]:
        """What an image model's --input writes besides --output and --errors, for the path
        checks (ttc/tasks/outputs.py: outputs_beside): (files, folders). From the flags
        alone, a detector's COCO images file, the overlay folder and a --mask_dir; with
        `segmenter` (a bundle's model type) also the default mask folder."""
        if not (self.input and self.output):
            return {}, {}
        from ttc.tasks.outputs import outputs_beside

        return outputs_beside(Path(self.output), masks=segmenter or self.mask_dir is not None,
                              mask_dir=Path(self.mask_dir) if self.mask_dir else None,
                              overlay=self.overlay, coco=self.output_format == "coco")

    def _check_engine(self, threads: Callable[[], int], profile: bool, online_ttt: bool
                      ) -> None:
        given = [f"--{name}" for name in RAY_FLAGS if getattr(self, name) is not None]
        if self.engine == "local" and given:
            raise ConfigError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} "
                              "only to --engine ray",
                              "add --engine ray, or drop them")
        if self.engine != "ray":
            return
        training = getattr(self, "script", None) in ("pipeline", "train")
        if training:  # Ray Train workers of --num_threads threads each
            threads = lambda: max(1, self.num_threads)  # noqa: E731
        elif not self.input:
            raise ConfigError("--engine ray predicts --input on a cluster; the test split's "
                              "evaluation runs in this process", "add --input and --output, or "
                              "drop --engine ray")
        for name in ("num_workers", "worker_batch_size"):
            if getattr(self, name) is not None:
                positive(name, getattr(self, name))
        check_ray_address(self.ray_address)
        if self.local_ray():
            self._require_local_cpus(threads())
        if training:
            return
        if profile:
            raise ConfigError("--profile profiles the ONNX Runtime session in this process, and "
                              "--engine ray predicts on worker processes",
                              "profile with --engine local on a sample of the input")
        if online_ttt:
            raise ConfigError("--ttt_mode online carries the adaptation from one batch to the "
                              "next in input order, and Ray workers predict batches in "
                              "parallel", "use --ttt_mode episodic on Ray, or --engine local")

    def local_ray(self) -> bool:
        """--engine ray on a cluster started for the run (no --ray_address, or `local`)."""
        return self.ray_address in (None, "local")

    def workers(self, threads: int) -> int:
        """--num_workers; by default 2, or 1 where a local cluster cannot hold two workers of
        `threads` threads each."""
        if self.num_workers is not None:
            return self.num_workers
        from ttc.serving.runtime import usable_cpus  # numpy: not at --help

        return max(1, min(2, usable_cpus() // threads)) if self.local_ray() else 2

    def _require_local_cpus(self, threads: int) -> None:
        """A local cluster has this machine's CPUs: more workers than they hold would never be
        placed (sizing the cluster to the request instead started them all, and hung)."""
        from ttc.serving.runtime import usable_cpus

        workers, cpus = self.workers(threads), usable_cpus()
        if workers * threads > cpus:
            asked = (f"--num_workers {workers} with {threads} thread(s) each needs"
                     if self.num_workers is not None else
                     f"one Ray worker with {threads} threads needs")
            raise ConfigError(f"{asked} {workers * threads} CPUs, and a local Ray cluster has "
                              f"this machine's {cpus}", "lower --num_workers or --num_threads, "
                              "or join a larger cluster with --ray_address")


def check_ray_address(address: str | None) -> None:
    """--ray_address's form, before any work: auto, local, or HOST:PORT ([IPv6]:PORT). Ray
    Client addresses (ray://) need Ray's client extra, which the tool does not install."""
    if address is None or address in ("auto", "local"):
        return
    if address.startswith("ray://"):
        raise ConfigError(f"invalid --ray_address {address!r}: a Ray Client address, which "
                          "this tool does not use", f"{RAY_ADDRESS_HINT}; run on a node of the "
                          "cluster with auto, or give the head node's host:port")
    host, colon, port = address.rpartition(":")
    if not (colon and _valid_host(host) and re.fullmatch(r"[0-9]{1,5}", port)
            and 1 <= int(port) <= 65535):
        bad("ray_address", address, RAY_ADDRESS_HINT)


def _valid_host(host: str) -> bool:
    """A host name or IPv4 address, or an IPv6 address in brackets."""
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
            return True
        except ValueError:
            return False
    return re.fullmatch(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?", host) is not None
