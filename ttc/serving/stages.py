"""What the inference stage hands a model type's code (its Parts.test_split and
Parts.new_input): the bundle opened on the test split, or the --input run with the ways to open
its graph here and on Ray workers. Plain data; the opening itself is ttc/online's (the one way
every caller opens a bundle), handed over as callables so that a type's own folder, which may
not import ttc/online, opens the graph as every other caller does.

`options` are the inference stage's options (ttc/options/stages.py's InferenceOptions, which
this layer does not import): the flags that stage reads, never the whole Config.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

if TYPE_CHECKING:
    import onnxruntime as ort

    from ttc.serving.bundle import BundlePaths
    from ttc.serving.cluster import RayOptions
    from ttc.serving.manifest import Manifest

Opened = tuple["Manifest", "ort.InferenceSession", Path]  # manifest, session, the graph's file


@dataclass
class SplitRun:
    """The test split's evaluation on one session of the chosen graph: the report sections it
    fills (`inference`, `evaluation`, and its test-time methods'), into `report`; `benchmark`
    and `baseline` (rows first in the table) for the types that draw the benchmark table."""

    options: Any  # ttc.options.stages.InferenceOptions
    paths: BundlePaths
    manifest: Manifest
    session: ort.InferenceSession
    model_path: Path
    test: tuple[np.ndarray, Any]
    val: tuple[np.ndarray, Any] | None
    report: dict
    benchmark: bool = False
    baseline: Sequence[Any] = ()
    calibration: tuple[np.ndarray, Any] | None = None  # the calibration slice, where loaded


@dataclass
class RayWorkers:
    """--engine ray for a type whose workers run its served part's runner
    (ttc.online.predictor.worker_runner): the manifest, the workers' runner factory (each
    worker's session built from the workers' flags) and where and how wide they run (chunks of
    whole --batch_size batches)."""

    manifest: Manifest
    runner_factory: Callable[[], Callable[[np.ndarray], Any]]
    options: RayOptions


@dataclass
class InputRun:
    """--input: the flags, the bundle, its graph's file key (`variant`: --variant, --quantized,
    --fp16), the report the run fills, and how that graph is opened in this process (`open`)
    or for Ray workers (`ray_workers`; the session made once here, so that a bundle or provider
    that cannot work fails now)."""

    options: Any  # ttc.options.stages.InferenceOptions
    paths: BundlePaths
    variant: str
    report: dict
    open: Callable[[], Opened]
    ray_workers: Callable[[], RayWorkers]


@dataclass
class Variant:
    """One way of running the model, for the benchmark table."""

    name: str
    provider: str
    size_bytes: int
    predict: Callable[[np.ndarray], np.ndarray]  # a batch → probabilities
