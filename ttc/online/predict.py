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

from config import Config
from ttc.online.evaluate import profile_graph
from ttc.online.predictor import (chunk_predictor, input_variant, load_bundle_session,
                                  worker_predictor, worker_runner)
from ttc.serving.bundle import BundlePaths, read_manifest
from ttc.serving.profiling import PROFILED_RUNS
from ttc.serving.runtime import graph_padding_id
from ttc.serving.stages import InputRun, RayWorkers
from ttc.tasks.registry import task_of_kind

if TYPE_CHECKING:
    import onnxruntime as ort

    from ttc.serving.batch import BatchOptions, Predictor
    from ttc.serving.cluster import RayOptions


def predict_new_data(config: Config, paths: BundlePaths, report: dict) -> None:
    """--input: the bundle's model type's `new_input` part (a classifier's: predict_rows)."""
    manifest = read_manifest(paths)
    predict = task_of_kind(manifest.preprocessing.kind).part("new_input")
    predict(InputRun(config, paths, report,
                     open=lambda: load_bundle_session(paths, config, input_variant(config)),
                     ray_workers=lambda: runner_workers(config, paths)))


def predict_rows(run: InputRun) -> None:
    """A classifier's --input: the chosen graph with the test-time compute asked for, over the
    input's chunks: in this process (batch.py), or on Ray workers (cluster.py) running the same
    predictor."""
    from ttc.serving.batch import BatchOptions, predict_input

    config, report = run.config, run.report
    chunk_rows = config.worker_batch_size or config.chunk_rows
    if config.ttt:  # whole adaptation batches per chunk, as if the input were read at once
        chunk_rows = -(-chunk_rows // config.batch_size) * config.batch_size
    options = BatchOptions.from_config(config, chunk_rows)
    if config.engine == "ray":
        predict_with_ray(config, run.paths, options, report)
        return
    manifest, session, model_path = run.open()
    predict, _ = chunk_predictor(config, run.paths, manifest, session, model_path)
    seen: list[np.ndarray] = []
    if config.profile:
        predict = keeping_first_rows(predict, seen, config.batch_size * PROFILED_RUNS)
    done = predict_input(options, manifest, predict, report)
    from ttc.serving.cluster import local_engine_section

    report["engine"] = local_engine_section(done, config.runtime().intra_op_threads)
    if config.profile and seen:
        report["profile"] = profile_graph(config.runtime(), config.batch_size,
                                          config.profile_path(), model_path,
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


def predict_with_ray(config: Config, paths: BundlePaths, options: BatchOptions,
                     report: dict) -> None:
    """--engine ray: workers (ray_worker_config) running the local engine's predictor."""
    from ttc.serving.cluster import predict_on_ray

    worker_config = ray_worker_config(config)
    # the workers' predictor built once here: a bundle, provider or test-time method that cannot
    # work fails now, with its own message, not as a worker that dies at start on the cluster
    manifest, session, model_path = load_bundle_session(paths, worker_config,
                                                        input_variant(config))
    chunk_predictor(worker_config, paths, manifest, session, model_path)
    ray_options = ray_options_of(config, options.chunk_rows, session)
    del session
    predict_on_ray(options, manifest, functools.partial(worker_predictor, worker_config), report,
                   ray_options)


def runner_workers(config: Config, paths: BundlePaths) -> RayWorkers:
    """--engine ray for a segmenter or a detector: chunks of --worker_batch_size images
    (default --batch_size; rounded up to whole --batch_size batches), run by workers whose
    served part's runner (predictor.worker_runner) is built from ray_worker_config."""
    worker_config = ray_worker_config(config)
    # the workers' session made once here: a bundle or provider that cannot work fails now
    manifest, session, _ = load_bundle_session(paths, worker_config, input_variant(config))
    chunk = -(-(config.worker_batch_size or config.batch_size) // config.batch_size) \
        * config.batch_size
    ray_options = ray_options_of(config, chunk, session)
    del session
    return RayWorkers(manifest, functools.partial(worker_runner, worker_config), ray_options)


def ray_worker_config(config: Config) -> Config:
    """A Ray worker's Config: --num_threads ONNX Runtime intra-op threads (its num_cpus: Ray's
    OMP_NUM_THREADS does not reach ONNX Runtime) and one inter-op thread, no progress bar, the
    bundle read by absolute path."""
    return dataclasses.replace(config, intra_op_threads=config.ray_threads(), inter_op_threads=1,
                               no_progress=True,
                               output_model=str(Path(config.output_model).absolute()))


def ray_options_of(config: Config, worker_batch_size: int,
                   session: ort.InferenceSession) -> RayOptions:
    """Where and how wide --engine ray runs: a GPU per worker where the session runs on one."""
    from ttc.serving.cluster import RayOptions

    gpu = session.get_providers()[0] in ("CUDAExecutionProvider", "TensorrtExecutionProvider")
    return RayOptions(None if config.local_ray() else config.ray_address, config.ray_workers(),
                      worker_batch_size, config.ray_threads(), 1.0 if gpu else 0.0,
                      config.log_level == "DEBUG")
