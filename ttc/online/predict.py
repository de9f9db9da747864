"""inference.py --input: new data predicted by the bundle's model type's `new_input` part
(Parts.new_input), given the ways to open the chosen graph (predictor.py's) here and for Ray
workers. A classifier's is here (`predict_rows`: the chosen graph with the test-time compute
asked for, over the input's chunks, in this process (ttc/serving/batch.py) or on Ray workers
(ttc/serving/cluster.py) running the same predictor); a segmenter's and a detector's sit in their
folders (ttc/tasks/segment/stages.py, ttc/tasks/detect/stages.py).
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ttc.online.evaluate import profile_graph
from ttc.online.predictor import (chunk_predictor, load_bundle_session, worker_predictor,
                                  worker_runner)
from ttc.options.stages import InferenceOptions
from ttc.serving.bundle import BundlePaths, read_manifest
from ttc.serving.profiling import PROFILED_RUNS
from ttc.serving.runtime import graph_padding_id
from ttc.serving.stages import InputRun, RayWorkers
from ttc.tasks.registry import task_of_kind

if TYPE_CHECKING:
    import onnxruntime as ort

    from ttc.serving.batch import BatchOptions, Predictor
    from ttc.serving.cluster import RayOptions


def predict_new_data(options: InferenceOptions, paths: BundlePaths, variant: str,
                     report: dict) -> None:
    """--input: the bundle's model type's `new_input` part (a classifier's: predict_rows), on
    its `variant` graph (predictor.input_variant)."""
    manifest = read_manifest(paths)
    predict = task_of_kind(manifest.preprocessing.kind).part("new_input")
    predict(InputRun(options, paths, variant, report,
                     open=lambda: load_bundle_session(paths, options, variant),
                     ray_workers=lambda: runner_workers(options, paths, variant)))


def predict_rows(run: InputRun) -> None:
    """A classifier's --input: the chosen graph with the test-time compute asked for, over the
    input's chunks: in this process (batch.py), or on Ray workers (cluster.py) running the same
    predictor."""
    from ttc.serving.batch import BatchOptions, predict_input

    options, report = run.options, run.report
    chunk_rows = options.worker_batch_size or options.chunk_rows
    if options.ttt:  # whole adaptation batches per chunk, as if the input were read at once
        chunk_rows = -(-chunk_rows // options.batch_size) * options.batch_size
    batch = BatchOptions.from_config(options, chunk_rows)
    if options.engine == "ray":
        predict_with_ray(run, batch)
        return
    manifest, session, model_path = run.open()
    predict, _ = chunk_predictor(options, run.paths, manifest, session, model_path)
    seen: list[np.ndarray] = []
    if options.profile:
        predict = keeping_first_rows(predict, seen, options.batch_size * PROFILED_RUNS)
    done = predict_input(batch, manifest, predict, report)
    from ttc.serving.cluster import local_engine_section

    report["engine"] = local_engine_section(done, options.runtime().intra_op_threads)
    if options.profile and seen:
        report["profile"] = profile_graph(options.runtime(), options.batch_size,
                                          options.profile_path(), model_path,
                                          np.concatenate(seen), graph_padding_id(session))


def keeping_first_rows(predict: Predictor, seen: list[np.ndarray], rows: int) -> Predictor:
    """`predict`, keeping in `seen` the first `rows` encoded rows it is given (what --profile
    then profiles the graph on, after the input is predicted)."""

    def keep(x: np.ndarray) -> tuple[np.ndarray, dict]:
        wanted = rows - sum(len(part) for part in seen)
        if wanted > 0:
            seen.append(x[:wanted].copy())
        return predict(x)

    return keep


def predict_with_ray(run: InputRun, batch: BatchOptions) -> None:
    """--engine ray: workers (ray_worker_options) running the local engine's predictor."""
    from ttc.serving.cluster import predict_on_ray

    worker_options = ray_worker_options(run.options)
    # the workers' predictor built once here: a bundle, provider or test-time method that cannot
    # work fails now, with its own message, not as a worker that dies at start on the cluster
    manifest, session, model_path = load_bundle_session(run.paths, worker_options, run.variant)
    chunk_predictor(worker_options, run.paths, manifest, session, model_path)
    ray_options = ray_options_of(run.options, batch.chunk_rows, session)
    del session
    predict_on_ray(batch, manifest,
                   functools.partial(worker_predictor, worker_options, run.variant), run.report,
                   ray_options)


def runner_workers(options: InferenceOptions, paths: BundlePaths, variant: str) -> RayWorkers:
    """--engine ray for a segmenter or a detector: chunks of --worker_batch_size images
    (default --batch_size; rounded up to whole --batch_size batches), run by workers whose
    served part's runner (predictor.worker_runner) is built from ray_worker_options."""
    worker_options = ray_worker_options(options)
    # the workers' session made once here: a bundle or provider that cannot work fails now
    manifest, session, _ = load_bundle_session(paths, worker_options, variant)
    chunk = -(-(options.worker_batch_size or options.batch_size) // options.batch_size) \
        * options.batch_size
    ray_options = ray_options_of(options, chunk, session)
    del session
    return RayWorkers(manifest, functools.partial(worker_runner, worker_options, variant),
                      ray_options)


def ray_worker_options(options: InferenceOptions) -> InferenceOptions:
    """A Ray worker's options: --num_threads ONNX Runtime intra-op threads (its num_cpus: Ray's
    OMP_NUM_THREADS does not reach ONNX Runtime) and one inter-op thread, no progress bar, the
    bundle read by absolute path."""
    return dataclasses.replace(options, intra_op_threads=options.ray_threads(),
                               inter_op_threads=1, no_progress=True,
                               output_model=str(Path(options.output_model).absolute()))


def ray_options_of(options: InferenceOptions, worker_batch_size: int,
                   session: ort.InferenceSession) -> RayOptions:
    """Where and how wide --engine ray runs: a GPU per worker where the session runs on one."""
    from ttc.serving.cluster import RayOptions

    gpu = session.get_providers()[0] in ("CUDAExecutionProvider", "TensorrtExecutionProvider")
    return RayOptions(None if options.local_ray() else options.ray_address, options.ray_workers(),
                      worker_batch_size, options.ray_threads(), 1.0 if gpu else 0.0,
                      options.log_level == "DEBUG")
