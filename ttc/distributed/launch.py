"""What --engine ray's training runs share, on the driver (driver.py's Ray Train run, search.py's
Ray Tune trials): the run's cluster and checkpoint folder, the payload the workers train from,
the checks made before training (GPUs, room on the cluster, a --model_def the workers can
import), and a finished run's checkpoint read back into the driver's student and trainer."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from ttc.distributed.worker import WorkerPayload, build_program
from ttc.inputs.data import Dataset
from ttc.nets.checkpoints import latest_single_run, new_run_id
from ttc.nets.device import precision_for
from ttc.nets.candidates import CandidateSearch
from ttc.nets.classifier_loop import EpochRunner, WeightTrainer
from ttc.nets.dspy_program import label_match, to_examples
from ttc.nets.epoch_loop import EpochRecord
from ttc.nets.finite import require_finite_weights
from ttc.nets.image_loop import ImagePlan, ImageRunner
from ttc.nets.training import TrainedModel, TrainingPlan, run_fingerprint, trained_model
from ttc.nets.shards import Shard
from ttc.serving.cluster import RayOptions
from ttc.tasks.base import resolve
from ttc.tasks.registry import task_for
from utils import LOG, ConfigError

if TYPE_CHECKING:
    from ttc.options.stages import TrainingOptions

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
    shard_rows: list[int] = field(default_factory=list)  # each worker's training rows
    shard_bytes: list[int] = field(default_factory=list)  # and what they take in memory

    @property
    def starts_file(self) -> Path:
        """Where the workers note each start (worker.record_start): restarts are counted."""
        return self.folder / f"ray-{self.run}" / "workers.starts"


def new_ray_run(options: TrainingOptions) -> RayRun:
    """The cluster to start or join, and this run's name in the checkpoint folder."""
    return RayRun(RayOptions(None if options.local_ray() else options.ray_address,
                             options.workers(options.ray_threads()), 0,
                             max(1, options.num_threads),
                             debug=options.log_level == "DEBUG"),
                  options.checkpoint_folder().absolute(), new_run_id())


def image_planner(model_type: str) -> Callable | None:
    """A segmenter's or a detector's plan_training (the module of its entry's `trainer` part,
    ttc/tasks/TYPE/training.py: an ImagePlan); None for a classifier (ttc/nets/training.py's
    plan_training, a TrainingPlan)."""
    task = task_for(model_type)
    if not task.image_loop:
        return None
    return resolve(task.parts.trainer.partition(":")[0] + ":plan_training")


def new_search(plan: TrainingPlan | ImagePlan, learning_rates: list[float],
               seeds: list[int]) -> CandidateSearch:
    """The model type's CandidateSearch over these candidates, as its local run builds it
    (a classifier's scores with dspy.Evaluate, a segmenter's and a detector's by the best
    epoch's validation mean IoU or mAP)."""
    if isinstance(plan, ImagePlan):
        return plan.search(plan.metric, plan.make_student, plan.make_trainer, learning_rates,
                           seeds)
    return CandidateSearch(label_match, plan.make_student, plan.make_trainer, learning_rates,
                           seeds)


def trained_of(plan: TrainingPlan | ImagePlan, program, search: CandidateSearch,
               dataset: Dataset, options: TrainingOptions) -> TrainedModel:
    """The TrainedModel a local run of this model type hands to export, for the search's kept
    candidate."""
    if isinstance(plan, ImagePlan):
        trained = plan.trained(program, search, dataset, plan.architecture, plan.started, options,
                               plan.transfer)
    else:
        trained = trained_model(program, search, dataset, plan.architecture, plan.started,
                                plan.transfer, options)
    trained.device, trained.amp = workers_device(options.use_gpu, options.amp)
    return trained


def workers_device(use_gpu: bool, amp: str) -> tuple[str, str]:
    """train.device and train.amp of a Ray run: its workers' (each resolves --amp on its own
    GPU, which the driver may not have)."""
    if not use_gpu:
        return "cpu", precision_for(amp, torch.device("cpu")).mode
    return "cuda (one GPU per worker)", (
        "auto: bf16 on a worker GPU that has it, else fp16" if amp == "auto" else amp)


def worker_payload(options: TrainingOptions, dataset: Dataset, plan: TrainingPlan | ImagePlan,
                   student, trainer, torch_rng: torch.Tensor, ray_run: RayRun) -> WorkerPayload:
    """What the workers train from; with --resume, the checkpoint to continue (checked against
    this run before any cluster starts)."""
    fingerprint = run_fingerprint(options, dataset, plan.architecture)
    resume_from = None
    if options.resume and not options.searches():  # a search's trials: search.py
        latest = latest_single_run(ray_run.folder, fingerprint,
                                   runner_of(plan).checkpoint_check(student.net))
        resume_from = str(latest[0].path)
        ray_run.resumed_from = int(latest[1]["epoch"])
        LOG.info("resuming from %s (epoch %d)", latest[0].path, ray_run.resumed_from)
    model_def = str(options.model_def_parts()[0].resolve()) if options.model_def else None
    return WorkerPayload(
        trainer=trainer, architecture=plan.architecture, preprocessing=dataset.preprocessing,
        labels=list(dataset.labels), weights=student.net.state_dict(), torch_rng=torch_rng,
        threads=max(1, options.num_threads), use_gpu=options.use_gpu, model_def=model_def,
        run=ray_run.run, storage=str(ray_run.folder), fingerprint=fingerprint,
        resume_from=resume_from, **training_data(dataset, plan, student, trainer))


def runner_of(plan: TrainingPlan | ImagePlan) -> type[EpochRunner] | type[ImageRunner]:
    """The epoch loop a plan's workers run."""
    return ImageRunner if isinstance(plan, ImagePlan) else EpochRunner


def training_data(dataset: Dataset, plan: TrainingPlan | ImagePlan, student,
                  trainer) -> dict:
    """The payload's data (x, y: every training row, and the Shard that says so; the
    validation examples) and how a worker builds and trains the program: a classifier's (its
    input field and tokenizer), or an ImagePlan's (its network builder, the program around
    it, ImageRunner)."""
    if isinstance(plan, ImagePlan):
        trainset = plan.examples(dataset.train)
        x, y = trainer._stack(trainset)
        return {"x": x, "y": y, "shard": Shard(len(x), units=trainer._units(y)),
                "devset": plan.examples(dataset.val) or trainset,
                "field": "", "tokenizer": None, "pad_id": 0, "build_net": plan.build_net,
                "wrap": plan.wrap, "runner": ImageRunner}
    trainset = to_examples(dataset.train, dataset.labels, plan.field)
    x, y = WeightTrainer._stack(student, trainset)
    return {"x": x, "y": y, "shard": Shard(len(x)),
            "devset": to_examples(dataset.val, dataset.labels, plan.field) or trainset,
            "field": plan.field, "tokenizer": student.tokenizer, "pad_id": student.pad_id}


def require_local_gpus(use_gpu: bool, options: RayOptions) -> None:
    """--use_gpu on a local cluster: this machine must have a GPU per worker (before Ray
    starts; a cluster's are counted once joined: require_room)."""
    if use_gpu and options.address is None and \
            torch.cuda.device_count() < options.workers:
        raise ConfigError(f"--use_gpu: {options.workers} worker(s) need a GPU each, and this "
                          f"machine has {torch.cuda.device_count()}",
                          "drop --use_gpu (the workers train on CPUs), or join a cluster with "
                          "GPUs with --ray_address")


def require_room(use_gpu: bool, options: RayOptions) -> None:
    """The joined cluster's GPUs for --use_gpu (its CPUs: connect checked them)."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if use_gpu and gpus < options.workers:
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


def restore(student, trainer, state: dict) -> None:
    """A checkpoint's best weights into the driver's `student` (on the CPU, in eval mode), its
    history, best epoch and first loss into `trainer`: what a local compile leaves."""
    student.net.load_state_dict(state["best"]["state"])
    student.net.cpu().eval()
    trainer.history = [EpochRecord(**record) for record in state["history"]]
    trainer.best_epoch, trainer.initial_loss = state["best"]["epoch"], state["initial_loss"]
    require_finite_weights(student.net, trainer.best_epoch, 0, trainer.learning_rate,
                           trainer.seed)
