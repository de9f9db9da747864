"""What a Ray Train worker runs: the DSPy program rebuilt from the driver's weights, wrapped in
DistributedDataParallel (ray.train.torch.prepare_model), trained by the local run's own
EpochRunner on its share of every batch; after each epoch rank 0 reports a checkpoint
(ray.train.report) and every worker continues from the latest one after a restart."""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import dspy
import torch

from ttc.nets.checkpoints import find_checkpoints, load_latest, read_state, write_checkpoint
from ttc.nets.models import build_model, register_model_source
from ttc.nets.program import (ClassifierProgram, EpochRunner, Sync, TrainingDiverged,
                              WeightTrainer)


@dataclass
class WorkerPayload:
    """Everything a worker trains from, put in Ray's object store once by the driver."""

    trainer: WeightTrainer  # the local run's settings (its checkpoints: none, Ray's instead)
    architecture: dict
    preprocessing: dict
    labels: list[str]
    field: str
    tokenizer: object
    pad_id: int
    weights: dict  # the student's starting state_dict (after --init_weights / --pretrained)
    torch_rng: torch.Tensor  # the driver's torch random state once the student was built
    x: torch.Tensor
    y: torch.Tensor
    devset: list[dspy.Example]
    threads: int
    use_gpu: bool
    model_def: str | None  # the --model_def file, imported by path on the worker
    run: str
    storage: str  # --checkpoint_dir, absolute
    fingerprint: dict
    resume_from: str | None = None  # --resume: the checkpoint folder to continue from
    meta: dict = field(default_factory=dict)


def build_program(payload: WorkerPayload) -> ClassifierProgram:
    """The driver's student, rebuilt here: the network from the manifest's architecture (a
    --model_def file imported by its path, which every node must have), the weights loaded."""
    if payload.model_def:
        register_model_source(Path(payload.model_def))
    net = build_model(payload.architecture, payload.preprocessing)
    net.load_state_dict(payload.weights)
    return ClassifierProgram(net, payload.labels, payload.field, payload.tokenizer,
                             payload.pad_id)


class CollectiveSync(Sync):
    """Sync over torch.distributed (gloo on CPUs, NCCL on GPUs); the seconds it spent."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.seconds = 0.0

    def sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        started = time.perf_counter()
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(tensor)
        self.seconds += time.perf_counter() - started
        return tensor.tolist()

    def agree(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        tensor = torch.tensor([int(flag)], device=self.device)
        torch.distributed.broadcast(tensor, 0)
        return bool(tensor.item())


class AllreduceTimer:
    """A DDP communication hook: PyTorch's own all-reduce of each gradient bucket, timed from
    the bucket's hand-over to the end of its all-reduce (it overlaps the backward pass; gloo
    reduces one bucket at a time), summed."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def hook(self, process_group, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        started = time.perf_counter()

        def done(future):
            self.seconds += time.perf_counter() - started
            return future.value()

        return allreduce_hook(process_group, bucket).then(done)


def starting_state(payload: WorkerPayload, reported) -> dict | None:
    """Where a worker starts: this run's latest checkpoint in the storage (after a restart;
    one Ray has not registered yet counts too), else the one Ray hands back, else the
    checkpoint --resume names; None: a fresh start."""
    by_epoch = sorted(find_checkpoints(Path(payload.storage), payload.run),
                      key=lambda found: found.meta.get("epoch", 0))
    latest = load_latest(by_epoch)
    if latest is not None:
        return latest[1]
    if reported is not None:
        with reported.as_directory() as folder:
            return read_state(Path(folder))
    return read_state(Path(payload.resume_from)) if payload.resume_from else None


def train_worker(config: dict) -> None:
    """Ray Train's train_loop_per_worker."""
    import ray
    import ray.train
    import ray.train.torch

    payload: WorkerPayload = ray.get(config["payload"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    if payload.threads > 0:
        torch.set_num_threads(payload.threads)
    program = build_program(payload)
    device = ray.train.torch.get_device() if payload.use_gpu else torch.device("cpu")
    state = starting_state(payload, ray.train.get_checkpoint())
    torch.set_rng_state(payload.torch_rng)
    if rank:  # its own dropout masks
        torch.manual_seed(payload.trainer.seed + rank)
    train_net = ray.train.torch.prepare_model(program.net)
    timer = AllreduceTimer()
    if isinstance(train_net, torch.nn.parallel.DistributedDataParallel):
        train_net.register_comm_hook(None, timer.hook)
    sync = CollectiveSync(rank, world, device)
    runner = EpochRunner(payload.trainer, program, payload.x, payload.y, payload.devset,
                         sync=sync, train_net=train_net, device=device)
    epochs: list[dict] = []
    if state is not None:
        runner.load_state_dict(state)
        epochs = list(state.get("engine_epochs", []))
    try:
        runner.run(lambda done: report_epoch(done, payload, rank, timer, sync, epochs))
    except TrainingDiverged as err:  # every worker saw the same loss: none is left waiting
        ray.train.report({"diverged": [err.epoch, err.batch, err.what]})


def report_epoch(runner: EpochRunner, payload: WorkerPayload, rank: int,
                 timer: AllreduceTimer, sync: CollectiveSync, epochs: list[dict]) -> None:
    """ray.train.report on every worker; rank 0's with the checkpoint (the runner's state, the
    same files a local run writes, and the timings of the epochs so far)."""
    import ray.train

    metrics = {"epoch": runner.epoch, "stopped": runner.stopped}
    if rank != 0:
        ray.train.report(metrics)
        return
    record = runner.trainer.history[-1]
    epochs.append({"epoch": runner.epoch, "seconds": record.seconds,
                   "allreduce_seconds": round(timer.seconds, 4),
                   "sync_seconds": round(sync.seconds, 4)})
    timer.seconds = sync.seconds = 0.0
    with tempfile.TemporaryDirectory() as folder:
        write_checkpoint(Path(folder), {**runner.state_dict(), "engine_epochs": epochs},
                         {**payload.meta, "run": payload.run, "epoch": runner.epoch,
                          "engine": "ray", "fingerprint": payload.fingerprint})
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
