"""--engine ray's driver: train a classifier, a segmenter or a detector on Ray Train and hand
back the TrainedModel a local run returns (export, quantization and the report take it as they
take a local one).

The driver plans the training as a local run does (ttc/nets/training.py plan_training for a
classifier: the data checks, the network, the student and its WeightTrainer; a segmenter's or
a detector's own plan_training, ttc/tasks/TYPE/training.py, for its ImageTrainer), connects to
the cluster (ttc/serving/cluster.py), checks that it can place the workers (and their GPUs,
and import a --model_def file; launch.py), runs a TorchTrainer whose workers run
worker.train_worker, and reads the last checkpoint: the best epoch's weights and the
history. A candidate search goes to search.py instead (its candidates as parallel Ray Tune
trials).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ttc.distributed.launch import (MAX_FAILURES, RayRun, check_model_def, image_planner,
                                    new_ray_run, new_search, require_local_gpus, require_room,
                                    restore, trained_of, worker_payload)
from ttc.distributed.worker import WorkerPayload, put_shards, read_starts, train_worker
from ttc.inputs.data import Dataset
from ttc.nets.checkpoints import read_state
from ttc.nets.candidates import Candidate
from ttc.nets.finite import TrainingDiverged
from ttc.nets.image_loop import ImagePlan
from ttc.nets.training import TrainedModel, TrainingPlan, engine_section, plan_training
from ttc.serving.cluster import driving_ray
from utils import LOG, ConfigError, stdout_to_stderr

if TYPE_CHECKING:
    from ttc.options.stages import TrainingOptions


def train_on_ray(options: TrainingOptions, dataset: Dataset) -> TrainedModel:
    """pipeline.py and train.py's training stage for --engine ray (a candidate search: its
    candidates as parallel Ray Tune trials, ttc/distributed/search.py)."""
    if options.searches():
        from ttc.distributed.search import search_on_ray

        return search_on_ray(options, dataset)
    plan = (image_planner(options.model_type) or plan_training)(options, dataset, engine="ray")
    rate, seed = options.learning_rates()[0], options.seed
    student = plan.make_student(seed)
    torch_rng = torch.get_rng_state()  # what a local run's first epoch starts from
    trainer = plan.make_trainer(rate, seed)
    ray_run = new_ray_run(options)
    payload = worker_payload(options, dataset, plan, student, trainer, torch_rng, ray_run)
    payload.starts = str(ray_run.starts_file)
    require_local_gpus(options.use_gpu, ray_run.options)
    with driving_ray(ray_run.options) as session:
        ray_run.address, ray_run.start_seconds = session.address, session.start_seconds
        state = fit(options, payload, ray_run)
    return finished(options, dataset, plan, student, trainer, state, ray_run)


def fit(options: TrainingOptions, payload: WorkerPayload, ray_run: RayRun) -> dict:
    """The TorchTrainer run: its last checkpoint's state (the best weights, the history)."""
    # Ray Train's controller polls its workers every 2 s by default and takes one report per
    # poll: 6 short digits epochs reached the driver 5 s after the last one ended, and a lost
    # worker was seen up to 2 s late. Polling every 0.5 s costs the controller nothing that
    # shows (a controller's env var: Ray passes the driver's on).
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    require_room(options.use_gpu, ray_run.options)
    workers, gpu = ray_run.options.workers, options.use_gpu
    shards, ray_run.shard_bytes = put_shards(payload, workers)
    ray_run.shard_rows = [payload.shard.of(rank, workers).size() for rank in range(workers)]
    shipped = ray.put(replace(payload, x=None, y=None))
    check_model_def(payload, shipped)
    LOG.info("training on Ray: %d worker(s) of %d thread(s)%s, checkpoints in %s", workers,
             payload.threads, " and a GPU each" if gpu else "", ray_run.folder)
    trainer = trainer_class(local=ray_run.options.address is None)(
        train_worker, train_loop_config={"payload": shipped, "shards": shards},
        torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=gpu,
                                     resources_per_worker={"CPU": payload.threads,
                                                           **({"GPU": 1} if gpu else {})}),
        run_config=RunConfig(name=f"ray-{ray_run.run}", storage_path=str(ray_run.folder),
                             failure_config=FailureConfig(max_failures=MAX_FAILURES),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    with stdout_to_stderr():
        result = trainer.fit()
    diverged = (result.metrics or {}).get("diverged")
    if diverged:
        raise TrainingDiverged(*diverged, payload.trainer.learning_rate, payload.trainer.seed)
    if result.checkpoint is None:
        raise ConfigError("the Ray run reported no checkpoint", "rerun with --log_level DEBUG")
    with result.checkpoint.as_directory() as folder:
        return read_state(Path(folder))


def trainer_class(local: bool) -> type:
    """Ray Train's TorchTrainer; on a local cluster, without its PlacementGroupCleaner: that
    watcher asks Ray's state API (the dashboard, which a local cluster does not start) whether
    the controller lives, and stopping it waited out its 12 s timeout at the end of every
    run. It removes a dead controller's placement group, which a local cluster's end
    removes anyway. (Ray 2.60's Train V2; another Ray keeps its own trainer.)"""
    from ray.train.torch import TorchTrainer

    try:
        from ray.train.v2._internal.callbacks.placement_group_callback import (
            PlacementGroupCleanerCallback)
    except ImportError:
        return TorchTrainer
    if not local or not hasattr(TorchTrainer, "_create_default_callbacks"):
        return TorchTrainer

    class LocalTorchTrainer(TorchTrainer):
        def _create_default_callbacks(self):
            return [callback for callback in super()._create_default_callbacks()
                    if not isinstance(callback, PlacementGroupCleanerCallback)]

    return LocalTorchTrainer


def finished(options: TrainingOptions, dataset: Dataset, plan: TrainingPlan | ImagePlan, student,
             trainer, state: dict, ray_run: RayRun) -> TrainedModel:
    """The TrainedModel of a local run, from the last checkpoint: the best epoch's weights in
    the driver's student, the history in its trainer; train.engine from the workers'
    timings."""
    restore(student, trainer, state)
    best = trainer.history[trainer.best_epoch - 1]
    search = new_search(plan, [trainer.learning_rate], [trainer.seed])
    search.candidates = [Candidate(0, trainer.learning_rate, trainer.seed, best.val_accuracy,
                                   best.val_loss if best.val_loss is not None else math.nan,
                                   trainer.best_epoch,
                                   round(time.perf_counter() - plan.started, 3))]
    search.chosen, search.chosen_trainer = 0, trainer
    trained = trained_of(plan, student, search, dataset, options)
    trained.engine = ray_engine_section(options, state.get("engine_epochs", []), ray_run)
    return trained


def ray_engine_section(options: TrainingOptions, epochs: list[dict], ray_run: RayRun) -> dict:
    """train.engine for a Ray run: per epoch, rank 0's seconds and its time in the gradients'
    all-reduce (the DDP hook's) and in the loss sums; the all-reduce's share of the epochs;
    the workers' restarts after a lost worker, and the epoch each continued from."""
    seconds = [e["seconds"] for e in epochs]
    allreduce = [e["allreduce_seconds"] for e in epochs]
    total = sum(seconds)
    starts = read_starts(ray_run.starts_file)
    return engine_section(
        "ray", ray_run.address, ray_run.options.workers, ray_run.options.threads, seconds,
        allreduce_seconds=allreduce,
        allreduce_share=round(sum(allreduce) / total, 4) if total else None,
        sync_seconds=[e["sync_seconds"] for e in epochs], use_gpu=options.use_gpu,
        cluster_start_s=round(ray_run.start_seconds, 3), checkpoint_dir=str(ray_run.folder),
        resumed_from_epoch=ray_run.resumed_from, max_failures=MAX_FAILURES,
        shard_rows=ray_run.shard_rows, shard_bytes=ray_run.shard_bytes,
        restarts=max(0, len(starts) - 1), restarted_from_epochs=starts[1:])
