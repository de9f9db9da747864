"""What a Ray Train worker runs: the DSPy program rebuilt from the driver's weights, wrapped in
DistributedDataParallel (ray.train.torch.prepare_model), trained by the local run's own epoch
loop (a classifier's EpochRunner, a segmenter's or a detector's ImageRunner) on its shard of
the training rows (the only rows put in the object store for it: ttc/nets/shards.py), training
the rows of every batch it holds; after each epoch rank 0 reports a checkpoint
(ray.train.report) and every worker continues from the latest one after a restart. A Ray Tune
trial of the candidate search (train_trial) runs the same code in one process."""
from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import dspy
import numpy as np
import torch

from ttc.nets.checkpoints import find_checkpoints, load_latest, read_state, write_checkpoint
from ttc.nets.models import build_model, register_model_source
from ttc.nets.classifier_loop import EpochRunner
from ttc.nets.dspy_program import ClassifierProgram
from ttc.nets.epoch_loop import EpochLoop, Sync
from ttc.nets.finite import TrainingDiverged
from ttc.nets.shards import Shard


@dataclass
class WorkerPayload:
    """Everything a worker trains from, put in Ray's object store once by the driver. A
    classifier's program is a ClassifierProgram around build_model's network; a segmenter's
    or a detector's is `wrap` around `build_net`'s, trained by `runner` (ImageRunner)."""

    trainer: object  # the local run's WeightTrainer or ImageTrainer (checkpoints: Ray's)
    architecture: dict
    preprocessing: dict
    labels: list[str]
    field: str
    tokenizer: object
    pad_id: int
    weights: dict  # the student's starting state_dict (after --init_weights / --pretrained)
    torch_rng: torch.Tensor  # the driver's torch random state once the student was built
    x: torch.Tensor | None  # the rows of `shard` (None in what the driver ships: put_shards)
    y: object
    devset: list[dspy.Example]
    threads: int
    use_gpu: bool
    model_def: str | None  # the --model_def file, imported by path on the worker
    run: str
    storage: str  # --checkpoint_dir, absolute
    fingerprint: dict
    resume_from: str | None = None  # --resume: the checkpoint folder to continue from
    starts: str | None = None  # the file each start of the workers adds a line to
    meta: dict = field(default_factory=dict)
    build_net: Callable = build_model  # (architecture, preprocessing) → the network
    wrap: Callable | None = None  # network → the DSPy program (None: a ClassifierProgram)
    runner: type = EpochRunner  # the epoch loop (ttc/nets/epoch_loop.py EpochLoop)
    shard: Shard | None = None  # which rows x and y are (None: all)


def put_shards(payload: WorkerPayload, world: int) -> tuple[list, list[int]]:
    """The training rows of each of `world` workers in Ray's object store, one object each
    (a worker fetches only its own), and the bytes of each; payload.shard is the whole
    split's."""
    import ray

    refs, sizes = [], []
    for rank in range(world):
        shard = payload.shard.of(rank, world)
        rows = (shard.rows(payload.x), shard.rows(payload.y))
        refs.append(ray.put(rows))
        sizes.append(data_bytes(*rows))
    return refs, sizes


def data_bytes(x: torch.Tensor, y) -> int:
    """What a process's training rows take in memory (images or token ids, and targets)."""
    targets = (y.numel() * y.element_size() if isinstance(y, torch.Tensor)
               else sum(getattr(item, "nbytes", 0) for item in y))
    return x.numel() * x.element_size() + targets


def build_program(payload: WorkerPayload) -> dspy.Module:
    """The driver's student, rebuilt here: the network from the manifest's architecture (a
    --model_def file imported by its path, which every node must have), the weights loaded."""
    if payload.model_def:
        register_model_source(Path(payload.model_def))
    net = payload.build_net(payload.architecture, payload.preprocessing)
    net.load_state_dict(payload.weights)
    if payload.wrap is not None:
        return payload.wrap(net)
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


def starting_state(payload: WorkerPayload, reported, net: torch.nn.Module) -> dict | None:
    """Where a worker starts: this run's latest usable checkpoint in the storage (after a
    restart; one Ray has not registered yet counts too), checked against `net`, else the one
    Ray hands back, else the checkpoint --resume names (the driver checked it); None: a fresh
    start."""
    by_epoch = sorted(find_checkpoints(Path(payload.storage), payload.run),
                      key=lambda found: found.meta.get("epoch", 0))
    latest = load_latest(by_epoch, payload.runner.checkpoint_check(net))
    if latest is not None:
        return latest[1]
    if reported is not None:
        with reported.as_directory() as folder:
            return read_state(Path(folder))
    return read_state(Path(payload.resume_from)) if payload.resume_from else None


@dataclass
class Session:
    """How a training process talks to Ray: a Ray Train worker's (ray.train: its rank among
    the DDP workers) or a Ray Tune trial's (ray.tune: one process alone). `report` takes
    (metrics, checkpoint=...); `reported` is the checkpoint Ray hands back after a
    restart."""

    rank: int
    world: int
    report: Callable
    checkpoint: type  # ray.train.Checkpoint or ray.tune.Checkpoint
    reported: object | None
    device: torch.device


def train_worker(config: dict) -> None:
    """Ray Train's train_loop_per_worker."""
    import ray
    import ray.train
    import ray.train.torch

    payload: WorkerPayload = ray.get(config["payload"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    x, y = ray.get(config["shards"][rank])
    payload = replace(payload, x=x, y=y, shard=payload.shard.of(rank, world))
    device = ray.train.torch.get_device() if payload.use_gpu else torch.device("cpu")
    session = Session(rank, world, ray.train.report, ray.train.Checkpoint,
                      ray.train.get_checkpoint(), device)
    train_process(payload, session, ray.train.torch.prepare_model)


def train_trial(config: dict, base: WorkerPayload | None = None,
                candidates: list | None = None) -> None:
    """A Ray Tune trial of the candidate search (ttc/distributed/search.py): one training run
    of candidate config["candidate"], in this one process: `base` is what every candidate
    shares (the data, the network), `candidates` the object refs of what each changes (its
    WeightTrainer, starting weights and random state, run and fingerprint)."""
    import ray
    import ray.tune

    overrides = ray.get(candidates[config["candidate"]])
    payload = replace(base, **overrides)
    device = torch.device("cuda") if payload.use_gpu else torch.device("cpu")
    session = Session(0, 1, ray.tune.report, ray.tune.Checkpoint, ray.tune.get_checkpoint(),
                      device)
    train_process(payload, session, None)


def train_process(payload: WorkerPayload, session: Session,
                  prepare: Callable[[torch.nn.Module], torch.nn.Module] | None) -> None:
    """One process's training: the local run's epoch loop from the driver's weights and
    random state (or the latest checkpoint after a restart), a checkpoint reported after every
    epoch; `prepare` wraps the network for DDP (None: trained as it is)."""
    rank, world = session.rank, session.world
    if payload.threads > 0:
        torch.set_num_threads(payload.threads)
    program = build_program(payload)
    state = starting_state(payload, session.reported, program.net)
    if rank == 0:
        record_start(payload, state)
    torch.set_rng_state(payload.torch_rng)
    train_net = prepare(program.net) if prepare is not None else program.net
    timer = AllreduceTimer()
    if isinstance(train_net, torch.nn.parallel.DistributedDataParallel):
        train_net.register_comm_hook(None, timer.hook)
    sync = CollectiveSync(rank, world, session.device)
    runner = payload.runner(payload.trainer, program, payload.x, payload.y, payload.devset,
                            sync=sync, train_net=train_net, device=session.device,
                            shard=payload.shard)
    epochs: list[dict] = []
    if state is not None:
        runner.load_state_dict(state)
        epochs = list(state.get("engine_epochs", []))
    if rank:  # its own dropout masks and TTA views (a checkpoint holds rank 0's generators)
        own_random_numbers(payload.trainer, rank, runner.epoch)
    first = runner.epoch
    try:
        runner.run(lambda done: report_epoch(done, payload, session, timer, sync, epochs))
    except TrainingDiverged as err:  # every worker saw the same loss: none is left waiting
        session.report({"diverged": [err.epoch, err.batch, err.what]})
        return
    if runner.epoch == first:  # a finished run resumed: no epoch ran, so report the state
        report_checkpoint(runner, payload, session, epochs,  # resumed, as a last checkpoint
                          {"epoch": runner.epoch, "stopped": runner.stopped,
                           "resumed_finished": True})


def own_random_numbers(trainer, rank: int, epoch: int) -> None:
    """Seed this process's dropout masks and TTA views apart from rank 0's (and from its own
    before a restart at `epoch`); the batch order's generator stays shared."""
    torch.manual_seed(trainer.seed + rank + 7919 * epoch)
    if hasattr(trainer, "view_rng"):
        trainer.view_rng = np.random.default_rng([trainer.seed, rank, epoch])


def record_start(payload: WorkerPayload, state: dict | None) -> None:
    """One line per start of the workers in payload.starts (the epoch it continues from): a
    restart after a lost worker adds one, before its first checkpoint too, and the driver
    reports their count."""
    if not payload.starts:
        return
    path = Path(payload.starts)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps({"epoch": int(state["epoch"]) if state else 0,
                              "time": time.time()}) + "\n")


def read_starts(path: Path) -> list[int]:
    """The epochs the workers started from, one per start (payload.starts)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    return [int(json.loads(line)["epoch"]) for line in lines if line.strip()]


def report_epoch(runner: EpochLoop, payload: WorkerPayload, session: Session,
                 timer: AllreduceTimer, sync: CollectiveSync, epochs: list[dict]) -> None:
    """Ray's report on every process; rank 0's with the checkpoint (the runner's state, the
    same files a local run writes, and the timings of the epochs so far)."""
    if session.rank == 0:
        record = runner.trainer.history[-1]
        epochs.append({"epoch": runner.epoch, "seconds": record.seconds,
                       "allreduce_seconds": round(timer.seconds, 4),
                       "sync_seconds": round(sync.seconds, 4)})
        timer.seconds = sync.seconds = 0.0
    report_checkpoint(runner, payload, session, epochs,
                      {"epoch": runner.epoch, "stopped": runner.stopped})


def report_checkpoint(runner: EpochLoop, payload: WorkerPayload, session: Session,
                      epochs: list[dict], metrics: dict) -> None:
    """`metrics` to Ray from every process; rank 0's with the checkpoint: the runner's state
    (the same files a local run writes) and the timings of the epochs so far."""
    if session.rank != 0:
        session.report(metrics)
        return
    with tempfile.TemporaryDirectory() as folder:
        write_checkpoint(Path(folder), {**runner.state_dict(), "engine_epochs": epochs},
                         {**payload.meta, "run": payload.run, "epoch": runner.epoch,
                          "engine": "ray", "fingerprint": payload.fingerprint})
        session.report(metrics, checkpoint=session.checkpoint.from_directory(folder))
