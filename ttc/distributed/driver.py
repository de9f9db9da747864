"""--engine ray's driver: train a classifier on Ray Train and hand back the TrainedModel a local
run returns (export, quantization and the report take it as they take a local one).

The driver plans the training as a local run does (ttc/nets/program.py plan_training: the
data checks, the network, the student and its WeightTrainer), connects to the cluster
(ttc/serving/cluster.py), checks that it can place the workers (and their GPUs, and import a
--model_def file), runs a TorchTrainer whose workers run worker.train_worker, and reads the
last checkpoint: the best epoch's weights and the history.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from config import Config
from ttc.distributed.worker import WorkerPayload, build_program, train_worker
from ttc.inputs.data import Dataset
from ttc.nets.checkpoints import (check_resumable, find_checkpoints, load_latest, new_run_id,
                                  read_state)
from ttc.nets.program import (Candidate, CandidateSearch, EpochRecord, TrainedModel,
                              TrainingDiverged, WeightTrainer, engine_section, label_match,
                              plan_training, require_finite_weights, run_fingerprint,
                              to_examples, trained_model)
from ttc.serving.cluster import RayOptions, connect, stop_ray, unwrapped
from utils import LOG, ConfigError, stdout_to_stderr

# a worker lost mid-run (killed, its node gone): the run restarts from the last checkpoint this
# many times before it fails
MAX_FAILURES = 3


@dataclass
class RayRun:
    """What the driver learned on the way: the cluster, and the run's checkpoint folder."""

    options: RayOptions
    folder: Path
    run: str
    address: str | None = None
    start_seconds: float = 0.0
    resumed_from: int | None = None


def train_on_ray(config: Config, dataset: Dataset) -> TrainedModel:
    """pipeline.py and train.py's training stage for --engine ray."""
    plan = plan_training(config, dataset, engine="ray")
    rate, seed = config.learning_rates()[0], config.seed
    student = plan.make_student(seed)
    torch_rng = torch.get_rng_state()  # what a local run's first epoch starts from
    trainer = plan.make_trainer(rate, seed)
    ray_run = RayRun(RayOptions(None if config.local_ray() else config.ray_address,
                                config.ray_workers(), 0, max(1, config.num_threads),
                                debug=config.log_level == "DEBUG"),
                     config.checkpoint_folder().absolute(), new_run_id())
    payload = worker_payload(config, dataset, plan, student, trainer, torch_rng, ray_run)
    require_local_gpus(config, ray_run.options)
    try:
        ray_run.address, ray_run.start_seconds = connect(ray_run.options)
        state = fit(config, payload, ray_run)
    except Exception as err:  # noqa: BLE001 - a worker's own error comes back wrapped by Ray
        raise unwrapped(err) from None
    finally:
        stop_ray(None, local=ray_run.options.address is None)
    return finished(config, dataset, plan, student, trainer, state, ray_run)


def worker_payload(config: Config, dataset: Dataset, plan, student, trainer: WeightTrainer,
                   torch_rng: torch.Tensor, ray_run: RayRun) -> WorkerPayload:
    """What the workers train from; with --resume, the checkpoint to continue (checked against
    this run before any cluster starts)."""
    trainset = to_examples(dataset.train, dataset.labels, plan.field)
    x, y = WeightTrainer._stack(student, trainset)
    fingerprint = run_fingerprint(config, dataset, plan.architecture)
    resume_from = None
    if config.resume:
        latest = load_latest(find_checkpoints(ray_run.folder))
        if latest is None:
            raise ConfigError(f"--resume: {ray_run.folder} holds no readable checkpoint",
                              "drop --resume to start afresh")
        check_resumable(latest[0], fingerprint)
        resume_from = str(latest[0].path)
        ray_run.resumed_from = int(latest[1]["epoch"])
        LOG.info("resuming from %s (epoch %d)", latest[0].path, ray_run.resumed_from)
    model_def = str(config.model_def_parts()[0].resolve()) if config.model_def else None
    return WorkerPayload(
        trainer=trainer, architecture=plan.architecture, preprocessing=dataset.preprocessing,
        labels=list(dataset.labels), field=plan.field, tokenizer=student.tokenizer,
        pad_id=student.pad_id, weights=student.net.state_dict(), torch_rng=torch_rng,
        x=x, y=y, devset=to_examples(dataset.val, dataset.labels, plan.field) or trainset,
        threads=max(1, config.num_threads), use_gpu=config.use_gpu, model_def=model_def,
        run=ray_run.run, storage=str(ray_run.folder), fingerprint=fingerprint,
        resume_from=resume_from)


def require_local_gpus(config: Config, options: RayOptions) -> None:
    """--use_gpu on a local cluster: this machine must have a GPU per worker (before Ray
    starts; a cluster's are counted once joined: require_room)."""
    if config.use_gpu and options.address is None and \
            torch.cuda.device_count() < options.workers:
        raise ConfigError(f"--use_gpu: {options.workers} worker(s) need a GPU each, and this "
                          f"machine has {torch.cuda.device_count()}",
                          "drop --use_gpu (the workers train on CPUs), or join a cluster with "
                          "GPUs with --ray_address")


def require_room(config: Config, options: RayOptions) -> None:
    """The joined cluster's GPUs for --use_gpu (its CPUs: connect checked them)."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if config.use_gpu and gpus < options.workers:
        raise ConfigError(f"--use_gpu: {options.workers} worker(s) need a GPU each, and the Ray "
                          f"cluster has {gpus:g}", "drop --use_gpu, lower --num_workers, or "
                          "add GPU nodes to the cluster")


def check_model_def(payload: WorkerPayload, shipped) -> None:
    """A --model_def file must import on the workers (every node needs it at the same path):
    one task builds the network on the cluster before training starts."""
    if not payload.model_def:
        return
    import ray

    def build(received: WorkerPayload) -> str | None:
        try:
            build_program(received)
        except BaseException as err:  # noqa: BLE001 - the user's code: any failure is reported
            text = str(err).strip()
            return f"{type(err).__name__}: {text.splitlines()[0]}" if text else repr(err)
        return None

    error = ray.get(ray.remote(num_cpus=payload.threads)(build).remote(shipped))
    if error:
        raise ConfigError(f"--model_def {payload.model_def} cannot be built on the Ray "
                          f"workers: {error}", "put the file, and what it imports, at the same "
                          "path on every node of the cluster (e.g. on shared storage)")


def fit(config: Config, payload: WorkerPayload, ray_run: RayRun) -> dict:
    """The TorchTrainer run: its last checkpoint's state (the best weights, the history)."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    require_room(config, ray_run.options)
    shipped = ray.put(payload)
    check_model_def(payload, shipped)
    workers, gpu = ray_run.options.workers, config.use_gpu
    LOG.info("training on Ray: %d worker(s) of %d thread(s)%s, checkpoints in %s", workers,
             payload.threads, " and a GPU each" if gpu else "", ray_run.folder)
    trainer = TorchTrainer(
        train_worker, train_loop_config={"payload": shipped},
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


def finished(config: Config, dataset: Dataset, plan, student, trainer: WeightTrainer,
             state: dict, ray_run: RayRun) -> TrainedModel:
    """The TrainedModel of a local run, from the last checkpoint: the best epoch's weights in
    the driver's student, the history in its trainer; train.engine from the workers'
    timings."""
    student.net.load_state_dict(state["best"]["state"])
    student.net.cpu().eval()
    trainer.history = [EpochRecord(**record) for record in state["history"]]
    trainer.best_epoch, trainer.initial_loss = state["best"]["epoch"], state["initial_loss"]
    require_finite_weights(student.net, trainer.best_epoch, 0, trainer.learning_rate,
                           trainer.seed)
    best = trainer.history[trainer.best_epoch - 1]
    search = CandidateSearch(label_match, plan.make_student, plan.make_trainer,
                             [trainer.learning_rate], [trainer.seed])
    search.candidates = [Candidate(0, trainer.learning_rate, trainer.seed, best.val_accuracy,
                                   best.val_loss if best.val_loss is not None else math.nan,
                                   trainer.best_epoch,
                                   round(time.perf_counter() - plan.started, 3))]
    search.chosen, search.chosen_trainer = 0, trainer
    trained = trained_model(student, search, dataset, plan.architecture, plan.started,
                            plan.transfer, config)
    trained.engine = ray_engine_section(config, state.get("engine_epochs", []), ray_run)
    return trained


def ray_engine_section(config: Config, epochs: list[dict], ray_run: RayRun) -> dict:
    """train.engine for a Ray run: per epoch, rank 0's seconds and its time in the gradients'
    all-reduce (the DDP hook's) and in the loss sums; the all-reduce's share of the epochs."""
    seconds = [e["seconds"] for e in epochs]
    allreduce = [e["allreduce_seconds"] for e in epochs]
    total = sum(seconds)
    return engine_section(
        "ray", ray_run.address, ray_run.options.workers, ray_run.options.threads, seconds,
        allreduce_seconds=allreduce,
        allreduce_share=round(sum(allreduce) / total, 4) if total else None,
        sync_seconds=[e["sync_seconds"] for e in epochs], use_gpu=config.use_gpu,
        cluster_start_s=round(ray_run.start_seconds, 3), checkpoint_dir=str(ray_run.folder),
        resumed_from_epoch=ray_run.resumed_from, max_failures=MAX_FAILURES)
