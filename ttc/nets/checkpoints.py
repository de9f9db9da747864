"""Training checkpoints: the epoch loop's whole state (ttc/nets/program.py EpochLoop: a
classifier's EpochRunner, a segmenter's or a detector's ImageRunner), one folder per epoch,
written by a local run (--checkpoint_dir, --resume) and by Ray Train's rank 0 (ttc/distributed)
alike, so that either engine resumes what either wrote.

A checkpoint is a folder of two files: `state.pt` (torch.save of plain containers and tensors,
read back with weights_only=True: never pickle) and `meta.json` (which run, which epoch, when,
and the run's fingerprint, read without torch to find the latest). A local run keeps its
checkpoints in DIR/local-RUN/epoch-NNNN/, a Ray run in DIR/ray-RUN/checkpoint_*/ (Ray names
those); the latest of a folder is the one saved last.

A candidate search's checkpoints (--lr_candidates, --num_candidates) are each candidate's own run
(RUN-candK locally, RUN-trialK as a Ray Tune trial), its fingerprint with its learning rate and
seed, and their meta.json names the search (`search`: its run, the candidate, the grid of
learning rates and seeds): --resume with a search continues the latest search in the folder,
each candidate from its own latest checkpoint, whichever engine wrote it; a single run resumes
the latest checkpoint of a single run.
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


def of_single_runs(found: list[Found]) -> list[Found]:
    """The checkpoints of single runs (not a candidate search's)."""
    return [f for f in found if not f.meta.get("search")]


def search_key(run: str, candidate: int, grid: list) -> dict:
    """meta.json's `search`: which search a candidate's checkpoint belongs to (its first run's
    name), which candidate (from 1), and the search's (learning rate, seed) grid."""
    return {"run": run, "candidate": candidate, "grid": [[float(lr), int(s)] for lr, s in grid]}


def latest_search(root: Path, grid: list, fingerprint: dict) -> str:
    """--resume with a search: the run of the latest search in `root`, checked against this
    one (the same grid of learning rates and seeds, the same data, network and batch size);
    exit 2 naming the difference."""
    found = [f for f in find_checkpoints(root) if f.meta.get("search")]
    if not found:
        raise ConfigError(f"--resume: {root} holds no checkpoint of a candidate search",
                          "drop --resume to start afresh, or give the --checkpoint_dir of "
                          "the search to continue")
    latest = found[-1]
    key = latest.meta["search"]
    mine = search_key("", 0, grid)["grid"]
    for what, column in (("learning rates", 0), ("seeds", 1)):
        there = sorted({row[column] for row in key["grid"]})
        here = sorted({row[column] for row in mine})
        if there != here:
            raise ConfigError(f"--resume: the checkpoints in {root} were written by another "
                              f"candidate search ({what} {_listed(there)} there, "
                              f"{_listed(here)} here)", "resume with the flags and data of "
                              "that search, or give a fresh --checkpoint_dir")
    if key["grid"] != mine:
        raise ConfigError(f"--resume: the checkpoints in {root} were written by another "
                          "candidate search (its candidates in another order)",
                          "resume with the flags of that search")
    learning_rate, seed = key["grid"][key["candidate"] - 1]
    check_resumable(latest, {**fingerprint, "learning_rate": learning_rate, "seed": seed})
    return key["run"]


def _listed(values: list) -> str:
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def latest_of_candidate(root: Path, search: str, candidate: int,
                        fingerprint: dict) -> tuple[Found, dict] | None:
    """--resume: a search's candidate's latest readable checkpoint (any engine's), checked
    against the candidate's `fingerprint`; None (logged): it has none and starts afresh."""
    latest = load_latest([f for f in find_checkpoints(root)
                          if (f.meta.get("search") or {}).get("run") == search and
                          f.meta["search"].get("candidate") == candidate])
    if latest is None:
        LOG.info("candidate %d has no checkpoint: it starts afresh", candidate)
        return None
    check_resumable(latest[0], fingerprint)
    LOG.info("candidate %d resumes from %s (epoch %d)", candidate, latest[0].path,
             int(latest[1]["epoch"]))
    return latest


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
    search: dict | None = None  # a search's candidate: search_key (meta.json's `search`)
    search_run: str | None = None  # the search resumed (latest_search), found once

    def for_candidate(self, index: int, learning_rate: float, seed: int,
                      grid: list) -> "CheckpointStore":
        """Candidate `index` (from 0) of a search: its own run (RUN-candK), its fingerprint
        with its learning rate and seed, in the search this store resumes (or starts)."""
        if self.resume and self.search_run is None:
            self.search_run = latest_search(self.root, grid, self.fingerprint)
        search = self.search_run or self.run
        return CheckpointStore(self.root, f"{self.run}-cand{index + 1}",
                               {**self.fingerprint, "learning_rate": learning_rate,
                                "seed": seed}, self.resume,
                               search=search_key(search, index + 1, grid))

    def start_state(self) -> dict | None:
        """The state to continue from (None: start afresh), checked against this run: a single
        run's latest checkpoint; a candidate's own latest (none: it starts afresh)."""
        if not self.resume:
            return None
        if self.search is not None:
            latest = latest_of_candidate(self.root, self.search["run"], self.search["candidate"],
                                         self.fingerprint)
            if latest is None:
                return None
            self.resumed_from = int(latest[1]["epoch"])
            return latest[1]
        latest = load_latest(of_single_runs(find_checkpoints(self.root)))
        if latest is None:
            raise ConfigError(f"--resume: {self.root} holds no readable checkpoint of a single "
                              "run", "drop --resume to start afresh, or give the "
                              "--checkpoint_dir of the run to continue")
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
                "fingerprint": self.fingerprint,
                **({"search": self.search} if self.search else {})}
