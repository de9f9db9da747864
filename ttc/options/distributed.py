"""Distributed training's flags (pipeline.py and train.py --engine ray: Ray Train workers under
DistributedDataParallel) and the training checkpoints that any run may keep and resume
(--checkpoint_dir, --resume). --engine, --ray_address and --num_workers are batch.py's, shared
with inference.py and serve.py."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ttc.options.fields import opt, parse_bool
from utils import ConfigError, same_file, unwritable

TRAINING_SCRIPTS = ("pipeline", "train")
CHECKPOINT_SUFFIX = ".checkpoints"


@dataclass
class DistributedFlags:
    use_gpu: bool = opt(False, "--engine ray: one GPU per training worker (DDP over NCCL); "
                        "refused when the cluster (or, for a local one, this machine) has "
                        "fewer GPUs than --num_workers", "distributed", type=parse_bool,
                        metavar="BOOL", scripts="PT")
    checkpoint_dir: str | None = opt(None, "where training writes a checkpoint after every "
                                     "epoch (weights, optimizer, schedule, random state, "
                                     "history): always for --engine ray (default: beside the "
                                     "bundle, OUTPUT-STEM.checkpoints), and for a local run "
                                     "when this or --resume is given; on a multi-node "
                                     "cluster a folder every node shares", "distributed",
                                     metavar="DIR", scripts="PT")
    resume: bool = opt(False, "continue the interrupted (or finished) training whose latest "
                       "checkpoint lies in --checkpoint_dir, local or Ray's, from the epoch "
                       "after it; the data, network, --batch_size, learning rate and --seed "
                       "must be that run's (--epochs may grow). With a candidate search: the "
                       "latest search there, each candidate from its own latest checkpoint "
                       "(a finished one is not trained again), the same learning rates and "
                       "seeds", "distributed",
                       type=parse_bool, metavar="BOOL", scripts="PT")

    def trains_on_ray(self) -> bool:
        return getattr(self, "script", None) in TRAINING_SCRIPTS and self.engine == "ray"

    def checkpoint_folder(self) -> Path | None:
        """Where this run keeps its checkpoints: --checkpoint_dir, or beside the bundle
        (OUTPUT-STEM.checkpoints) for a Ray run or --resume; None: a local run keeps none."""
        if self.checkpoint_dir:
            return Path(self.checkpoint_dir)
        if (self.trains_on_ray() or self.resume) and getattr(self, "output_model", None):
            model = Path(self.output_model)
            return model.with_name(model.stem + CHECKPOINT_SUFFIX)
        return None

    def check_distributed(self) -> None:
        """--use_gpu only on Ray (--device names a local run's GPU); what --engine ray and the
        checkpoints do not train yet."""
        if getattr(self, "script", None) not in TRAINING_SCRIPTS:
            return
        if self.use_gpu and self.engine != "ray":
            raise ConfigError("--use_gpu applies only to --engine ray (a local run trains on "
                              "--device: the first GPU when there is one)",
                              "add --engine ray, or drop --use_gpu (and pick the GPU with "
                              "--device cuda:N)")
        if self.engine == "ray" and self.device.startswith("cuda"):
            raise ConfigError(f"--device {self.device} names the GPU of a local run; on "
                              "--engine ray each worker gets its own GPU with --use_gpu",
                              "replace --device with --use_gpu")
        if self.engine == "ray":  # a candidate search runs as parallel Ray Tune trials
            self._refuse_not_built("--engine ray", search_built=True)
            workers = self.ray_workers()
            if not self.searches() and self.batch_size < workers:
                raise ConfigError(f"--batch_size {self.batch_size} is smaller than the "
                                  f"{workers} Ray workers: each trains its share of every batch",
                                  f"raise --batch_size to {workers} or more, or lower "
                                  "--num_workers")
        if self.checkpoint_dir or self.resume:  # a search's candidates keep their own
            self._refuse_not_built("--checkpoint_dir and --resume", search_built=True)

    def searches(self) -> bool:
        """A candidate search: several learning rates (--lr_candidates), or seeds."""
        return len(self.learning_rates()) * self.num_candidates > 1

    def _refuse_not_built(self, what: str, search_built: bool = False) -> None:
        searched = self.searches() and not search_built
        for given, name in ((searched, "a candidate search (--lr_candidates, "
                                       "--num_candidates)"),
                            (bool(self.teacher_lm), "--teacher_lm"),
                            (getattr(self, "ensemble_size", 1) > 1, "--ensemble_size")):
            if given:
                raise ConfigError(f"{what} with {name} is not built yet",
                                  f"drop {name.split(' (')[0]}, or {what.split()[0]}")

    def check_checkpoint_folder(self, reads: dict[str, Path], writes: dict[str, Path]) -> None:
        """The checkpoint folder, before any work: a folder of its own (no input or output
        of the run), one that can be created; with --resume, one holding a checkpoint."""
        folder = self.checkpoint_folder()
        if folder is None or getattr(self, "script", None) not in TRAINING_SCRIPTS:
            return
        name = "--checkpoint_dir" if self.checkpoint_dir else \
            "the checkpoint folder (--checkpoint_dir's default)"
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"{name} {folder} is a file", "give a folder")
        for other, path in [*reads.items(), *writes.items()]:
            if same_file(folder, path):
                raise ConfigError(f"{name} {folder} is the same path as {other} {path}; nothing "
                                  "was read or written", "give --checkpoint_dir a folder of its "
                                  "own")
        problem = unwritable(folder / ".probe")
        if problem:
            raise ConfigError(f"{name} {folder} cannot be written: {problem}",
                              "choose a writable location")
        if self.resume and not any(_is_checkpoint(meta) for meta in folder.rglob("meta.json")):
            raise ConfigError(f"--resume: {folder} holds no checkpoint",
                              "drop --resume to start afresh, or give the --checkpoint_dir of "
                              "the run to continue")


def _is_checkpoint(meta: Path) -> bool:
    """A training checkpoint's meta.json (ttc/nets/checkpoints.py) beside its state.pt."""
    try:  # whether its content can be used is checked when it is read (checkpoints.read_meta)
        return (meta.parent / "state.pt").is_file() and meta.stat().st_size < 32 << 20 and \
            "run" in json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError, RecursionError):
        return False
