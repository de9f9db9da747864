"""Training checkpoints: the epoch loop's whole state (ttc/nets/program.py EpochLoop: a
classifier's EpochRunner, a segmenter's or a detector's ImageRunner), one folder per epoch,
written by a local run (--checkpoint_dir, --resume) and by Ray Train's rank 0 (ttc/distributed)
alike, so that either engine resumes what either wrote.

A checkpoint is a folder of two files: `state.pt` (torch.save of plain containers and tensors,
read back with weights_only=True: never pickle) and `meta.json` (which run, which epoch, when,
and the run's fingerprint, read without torch to find the latest). A local run keeps its
checkpoints in DIR/local-RUN/epoch-NNNN/, a Ray run in DIR/ray-RUN/checkpoint_*/ (Ray names
those); the latest of a folder is the one saved last.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from utils import LOG, ConfigError

STATE, META = "state.pt", "meta.json"
FORMAT = 1
KEEP = 2  # a local run's checkpoints kept (the last holds everything; one more in reserve)
# what must be equal for a checkpoint to be resumed (--epochs may grow)
FINGERPRINT_KEYS = ("model_type", "labels", "network", "num_parameters", "samples",
                    "batch_size", "learning_rate", "seed")


def new_run_id() -> str:
    """A run's name among the checkpoint folder's: when it started, and this process."""
    return time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"


@dataclass
class Found:
    """A checkpoint on disk: its folder and its meta.json."""

    path: Path
    meta: dict


def write_checkpoint(folder: Path, state: dict, meta: dict) -> None:
    """state.pt, then meta.json (a folder without meta.json is no checkpoint yet)."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / STATE)
    (folder / META).write_text(json.dumps({**meta, "format": FORMAT, "saved_at": time.time()}),
                               encoding="utf-8")


def read_state(folder: Path) -> dict:
    return torch.load(folder / STATE, map_location="cpu", weights_only=True)


def find_checkpoints(root: Path, run: str | None = None) -> list[Found]:
    """The checkpoints under `root` (of one run when `run` is given), oldest first; a folder
    whose meta.json cannot be read (a copy cut short) is left out."""
    found = []
    for meta_file in Path(root).rglob(META) if Path(root).is_dir() else []:
        try:
            meta = json.loads(meta_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and meta.get("format") == FORMAT and \
                (meta_file.parent / STATE).is_file() and (run is None or meta.get("run") == run):
            found.append(Found(meta_file.parent, meta))
    return sorted(found, key=lambda f: (f.meta.get("saved_at", 0), f.meta.get("epoch", 0)))


def load_latest(candidates: list[Found]) -> tuple[Found, dict] | None:
    """The newest candidate that loads (an older one where the newest is damaged)."""
    for found in reversed(candidates):
        try:
            return found, read_state(found.path)
        except Exception as err:  # noqa: BLE001 - a damaged file: fall back to the one before
            LOG.warning("checkpoint %s cannot be read (%s); trying the one before", found.path,
                        err)
    return None


def check_resumable(found: Found, fingerprint: dict) -> None:
    """--resume continues the same training: the checkpoint's data, network and optimiser
    settings must be this run's (only --epochs may differ). Exit 2 naming what differs."""
    saved = found.meta.get("fingerprint", {})
    differ = [key for key in FINGERPRINT_KEYS if saved.get(key) != fingerprint.get(key)]
    if differ:
        key = differ[0]
        raise ConfigError(f"--resume: the checkpoint {found.path} was written by another "
                          f"training ({key} {saved.get(key)!r} there, {fingerprint.get(key)!r} "
                          "here)", "resume with the flags and data of that run, or give a "
                          "fresh --checkpoint_dir")


@dataclass
class CheckpointStore:
    """Where a local run writes a checkpoint after each epoch, and the state it resumes from
    (--resume: the latest checkpoint in the folder, local or Ray's)."""

    root: Path
    run: str
    fingerprint: dict
    resume: bool = False
    written: list[Path] = field(default_factory=list)
    resumed_from: int | None = None  # the epoch of the checkpoint resumed

    def start_state(self) -> dict | None:
        """The state to continue from (None: start afresh), checked against this run."""
        if not self.resume:
            return None
        latest = load_latest(find_checkpoints(self.root))
        if latest is None:
            raise ConfigError(f"--resume: {self.root} holds no readable checkpoint",
                              "drop --resume to start afresh, or give the --checkpoint_dir of "
                              "the run to continue")
        found, state = latest
        check_resumable(found, self.fingerprint)
        self.resumed_from = int(state["epoch"])
        LOG.info("resuming from %s (epoch %d)", found.path, found.meta.get("epoch", 0))
        return state

    def save(self, state: dict, epoch: int) -> None:
        """DIR/local-RUN/epoch-NNNN, staged under a temporary name and moved into place; the
        run's checkpoints beyond the last KEEP removed."""
        folder = self.root / f"local-{self.run}" / f"epoch-{epoch:04d}"
        staged = folder.with_name(f".{folder.name}.tmp")
        shutil.rmtree(staged, ignore_errors=True)
        write_checkpoint(staged, state, self.meta(epoch, "local"))
        shutil.rmtree(folder, ignore_errors=True)
        staged.rename(folder)
        self.written.append(folder)
        for old in self.written[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
        self.written = self.written[-KEEP:]

    def meta(self, epoch: int, engine: str) -> dict:
        return {"run": self.run, "epoch": epoch, "engine": engine,
                "fingerprint": self.fingerprint}
