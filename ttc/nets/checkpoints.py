"""Training checkpoints: the epoch loop's whole state (ttc/nets/epoch_loop.py EpochLoop: a
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

A checkpoint is written by whoever can write the folder, so everything in it is checked before
any of it is used: meta.json against its schema (meta_problem: types, ranges, lengths, nesting),
state.pt read as every torch file is (load_torch_file: no ZIP bomb, weights_only) and checked
against the network and optimiser it is loaded into (state_problem: keys, shapes, dtypes, the
optimiser's state, the random generators). An unusable latest checkpoint is passed over, with a
WARNING, for the one before; a resume that finds none usable is exit 2 saying why.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from ttc.inputs.limits import MAX_LABELS
from ttc.nets.models import TorchFileError, load_torch_file
from utils import LOG, ConfigError, nesting_depth, quoted

STATE, META = "state.pt", "meta.json"
FORMAT = 1
KEEP = 2  # a local run's checkpoints kept (the last holds everything; one more in reserve)
# what must be equal for a checkpoint to be resumed (--epochs may grow)
FINGERPRINT_KEYS = ("model_type", "labels", "network", "num_parameters", "samples",
                    "batch_size", "learning_rate", "seed")
MAX_META_BYTES = 32 << 20  # a meta.json holds the labels: 100,000 of them fit many times over
MAX_META_DEPTH = 8  # meta.json nests 4 levels (search.grid[k][0])
MAX_NAME = 200  # characters of a run's name
MAX_EPOCH = 1_000_000
MAX_GRID = 10_000  # a search's candidates

# a checkpoint's state → what makes it unusable for the network it would be loaded into
StateCheck = Callable[[Any], "str | None"]


def new_run_id() -> str:
    """A run's name among the checkpoint folder's: when it started, and this process."""
    return time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"


@dataclass
class Found:
    """A checkpoint on disk: its folder and its meta.json; `problem`: why its meta.json cannot be
    used (then `meta` is empty)."""

    path: Path
    meta: dict
    problem: str | None = None


def write_checkpoint(folder: Path, state: dict, meta: dict) -> None:
    """state.pt, then meta.json (a folder without meta.json is no checkpoint yet)."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / STATE)
    (folder / META).write_text(json.dumps({**meta, "format": FORMAT, "saved_at": time.time()}),
                               encoding="utf-8")


def read_state(folder: Path) -> dict:
    """A checkpoint's state.pt, read as every torch file is (load_torch_file); exit 2 where it
    cannot be."""
    try:
        return load_torch_file(folder / STATE)
    except TorchFileError as err:
        raise ConfigError(f"the checkpoint {folder} cannot be read: {STATE}: {err}",
                          "give a fresh --checkpoint_dir, or drop --resume") from None


# ----------------------------------------------------------------------------- meta.json


def _is_int(value: Any, low: int = 0, high: int = MAX_EPOCH) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: Any) -> bool:
    """A finite number (an integer of any size is one)."""
    return _is_real(value) and (isinstance(value, numbers.Integral) or math.isfinite(value))


def _is_real(value: Any) -> bool:
    """A number as training keeps it (inf before the first validation loss), not NaN."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    return isinstance(value, numbers.Integral) or not math.isnan(value)


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, bool, int, float))


def _fingerprint_problem(value: Any) -> str | None:
    if not isinstance(value, dict):
        return f"fingerprint must be an object, not {quoted(value)}"
    for key in FINGERPRINT_KEYS:
        entry = value.get(key)
        if isinstance(entry, list):
            if len(entry) > MAX_LABELS or not all(map(_is_scalar, entry)):
                return f"fingerprint.{key} must be a list of at most {MAX_LABELS:,} names"
        elif not _is_scalar(entry):
            return f"fingerprint.{key} must be a name or a number, not {quoted(entry)}"
    return None


def _search_problem(value: Any) -> str | None:
    if not isinstance(value, dict):
        return f"search must be an object, not {quoted(value)}"
    grid = value.get("grid")
    if not (isinstance(grid, list) and 0 < len(grid) <= MAX_GRID and all(
            isinstance(row, list) and len(row) == 2 and _is_number(row[0]) and row[0] > 0
            and _is_int(row[1], -2**63, 2**63 - 1) for row in grid)):
        return "search.grid must be a list of [learning rate, seed] pairs"
    if not _is_name(value.get("run")):
        return f"search.run must be a run's name, not {quoted(value.get('run'))}"
    if not _is_int(value.get("candidate"), 1, len(grid)):
        return (f"search.candidate must be an integer from 1 to {len(grid)}, not "
                f"{quoted(value.get('candidate'))}")
    return None


# meta.json's fields: what each must be, and the test
META_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "run": ("a run's name", _is_name),
    "epoch": (f"an integer from 1 to {MAX_EPOCH}", lambda v: _is_int(v, 1)),
    "saved_at": ("a time in seconds", _is_number),
    "engine": ('"local" or "ray"', lambda v: v in ("local", "ray")),
}


def meta_problem(meta: Any) -> str | None:
    """What is wrong with a parsed meta.json (its keys, types, ranges); None when every field
    this module reads is of its type and in its range."""
    if not isinstance(meta, dict):
        return "content is not a JSON object"
    if meta.get("format") != FORMAT:
        return f"format is {quoted(meta.get('format'))}; this tool reads format {FORMAT}"
    for key, (what, test) in META_FIELDS.items():
        if key not in meta:
            return f"{key} is missing"
        if not test(meta[key]):
            return f"{key} must be {what}, not {quoted(meta[key])}"
    return _fingerprint_problem(meta.get("fingerprint")) or (
        _search_problem(meta["search"]) if meta.get("search") is not None else None)


def read_meta(path: Path) -> tuple[dict, str | None]:
    """A meta.json, parsed and checked: (its content, None), or ({}, why it cannot be used)."""
    try:
        if path.stat().st_size > MAX_META_BYTES:
            return {}, f"{META} is over {MAX_META_BYTES >> 20} MB, which none is"
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:  # a copy cut short
        return {}, f"{META} is not valid JSON ({quoted(err, 60)})"
    except RecursionError:
        meta = None
    if meta is None or nesting_depth(meta) > MAX_META_DEPTH:
        return {}, f"{META} nests deeper than {MAX_META_DEPTH} levels, which none does"
    problem = meta_problem(meta)
    return ({}, f"{META}'s {problem}") if problem else (meta, None)


def find_checkpoints(root: Path, run: str | None = None) -> list[Found]:
    """The checkpoints under `root` (of one run when `run` is given), oldest first (by when
    they were saved). A folder whose meta.json cannot be used (a copy cut short, an edited
    file) is listed too, by its time of writing, with its problem, where no run is asked for:
    load_latest passes over it saying why."""
    found = []
    for meta_file in Path(root).rglob(META) if Path(root).is_dir() else []:
        if not (meta_file.parent / STATE).is_file():
            continue
        meta, problem = read_meta(meta_file)
        if problem is None and (run is None or meta["run"] == run):
            found.append(((meta["saved_at"], meta["epoch"]), Found(meta_file.parent, meta)))
        elif problem is not None and run is None:
            written = meta_file.stat().st_mtime
            found.append(((written, 0), Found(meta_file.parent, meta, problem)))
    return [checkpoint for _, checkpoint in sorted(found, key=lambda pair: pair[0])]


# ----------------------------------------------------------------------------- state.pt

# the keys of every epoch loop's state (EpochLoop.state_dict) and what each must be
STATE_KEYS = ("epoch", "stopped", "net", "optimizer", "schedule", "generator", "torch_rng",
              "history", "best", "initial_loss")
STOPPING_KEYS = ("patience", "best_loss", "best_accuracy", "epochs_without_improvement")


def _shape(tensor: torch.Tensor) -> list[int]:
    return list(tensor.shape)


def weights_problem(weights: Any, net: nn.Module, name: str) -> str | None:
    """A state dict against `net`'s: the same keys, each tensor of its shape and dtype."""
    if not isinstance(weights, dict):
        return f"{name} is not a dictionary of tensors"
    expected = net.state_dict()
    missing = [key for key in expected if key not in weights]
    if missing:
        return f"{name} lacks the network's {quoted(missing[0], 60)}"
    extra = [key for key in weights if key not in expected]
    if extra:
        return f"{name} holds {quoted(extra[0], 60)}, which the network has not"
    for key, tensor in expected.items():
        saved = weights[key]
        if not torch.is_tensor(saved) or saved.shape != tensor.shape or \
                saved.dtype != tensor.dtype:
            what = (f"{_shape(saved)} {saved.dtype}" if torch.is_tensor(saved)
                    else f"not a tensor but {quoted(saved)}")
            return (f"{name}[{quoted(key, 60)}] is {what}, the network's "
                    f"{_shape(tensor)} {tensor.dtype}")
    return None


def _optimizer_problem(value: Any, net: nn.Module) -> str | None:
    """An optimiser's state dict for one over `net`'s parameters, in order: its groups name
    every parameter once, and each parameter's state holds scalars or tensors of its shape."""
    params = list(net.parameters())
    if not isinstance(value, dict) or not isinstance(value.get("state"), dict) or \
            not isinstance(value.get("param_groups"), list):
        return "optimizer is not an optimiser's state (state, param_groups)"
    groups = value["param_groups"]
    named: list = []
    for group in groups:
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            return "optimizer.param_groups holds a group without its params"
        if not all(_is_scalar(v) or isinstance(v, (list, tuple)) and len(v) <= 8 and
                   all(map(_is_real, v)) for k, v in group.items() if k != "params"):
            return "optimizer.param_groups holds a setting that is no number"
        named += group["params"]
    if named != list(range(len(params))):
        return (f"optimizer's groups name {len(named)} parameters, the network has "
                f"{len(params)}")
    for index, entry in value["state"].items():
        if not _is_int(index, 0, len(params) - 1) or not isinstance(entry, dict):
            return f"optimizer.state holds {quoted(index)}, which is no parameter's"
        shape = params[index].shape
        for key, saved in entry.items():
            if torch.is_tensor(saved) and not (saved.is_floating_point() and (
                    saved.dim() == 0 or saved.shape == shape)) or \
                    not torch.is_tensor(saved) and not _is_real(saved):
                what = _shape(saved) if torch.is_tensor(saved) else quoted(saved)
                return (f"optimizer.state[{index}][{quoted(key)}] is {what}, the parameter's "
                        f"shape {list(shape)}")
    return None


def _schedule_problem(value: Any, groups: int) -> str | None:
    if not (isinstance(value, dict) and _is_int(value.get("last_epoch"), -1, 2**62) and
            _is_int(value.get("_step_count"), 0, 2**62) and
            isinstance(value.get("_last_lr"), list) and len(value["_last_lr"]) == groups and
            all(map(_is_real, value["_last_lr"]))):
        return ("schedule must hold last_epoch, _step_count and _last_lr (a rate per group of "
                "parameters)")
    return None


def _generator_problem(value: Any, name: str) -> str | None:
    """A torch generator's state, as torch.Generator().get_state() gives it."""
    expected = torch.Generator().get_state()
    if not torch.is_tensor(value) or value.dtype != expected.dtype or \
            value.shape != expected.shape:
        what = f"{_shape(value)} {value.dtype}" if torch.is_tensor(value) else quoted(value)
        return f"{name} is {what}, not a generator's state ({_shape(expected)} {expected.dtype})"
    return None


def _records_problem(value: Any, name: str, fields: tuple[str, ...]) -> str | None:
    """A list of records of numbers (the history, a Ray run's epochs)."""
    if not isinstance(value, list) or not all(
            isinstance(record, dict) and (not fields or set(record) <= set(fields)) and
            all(v is None or _is_real(v) for v in record.values()) for record in value):
        return f"{name} must be a list of records of numbers"
    return None


def _best_problem(value: Any, net: nn.Module, epoch: int) -> str | None:
    if not isinstance(value, dict) or not all(k in value for k in ("score", "epoch", "state",
                                                                    "stopping")):
        return "best must hold score, epoch, state and stopping"
    if not _is_real(value["score"]) or not _is_int(value["epoch"], 0, epoch):
        return (f"best's score and epoch must be a number and an epoch up to {epoch}, not "
                f"{quoted(value['score'])} and {quoted(value['epoch'])}")
    stopping = value["stopping"]
    if not isinstance(stopping, dict) or not set(stopping) <= set(STOPPING_KEYS) or \
            not all(map(_is_real, stopping.values())):
        return f"best.stopping must hold numbers for {', '.join(STOPPING_KEYS)}"
    return weights_problem(value["state"], net, "best.state")


def _numpy_generator_problem(value: Any, name: str) -> str | None:
    """numpy's PCG64 state (the TTA views' generator), tried on a fresh generator."""
    try:
        if not isinstance(value, dict) or value.get("bit_generator") != "PCG64":
            raise ValueError
        np.random.PCG64().state = value
    except (ValueError, TypeError, KeyError, OverflowError):
        return f"{name} is not a PCG64 generator's state"
    return None


# the keys a subclass of the epoch loop adds (EpochLoop.checkpoint_extras), or a Ray run's
# checkpoint (engine_epochs), and their checks
EXTRA_CHECKS: dict[str, Callable[[Any, str], "str | None"]] = {
    "view_rng": _numpy_generator_problem,
    "engine_epochs": lambda value, name: _records_problem(value, name, ()),
}


def state_problem(state: Any, net: nn.Module, history_fields: tuple[str, ...],
                  extras: tuple[str, ...] = ()) -> str | None:
    """What makes a checkpoint's state unusable for an epoch loop training `net` (whose
    optimiser is over net.parameters(), in order), the history records of `history_fields`
    and the loop's `extras` keys; None when every part is of its type and shape."""
    if not isinstance(state, dict):
        return "content is not a dictionary"
    missing = [key for key in (*STATE_KEYS, *extras) if key not in state]
    if missing:
        return f"{missing[0]} is missing"
    epoch = state["epoch"]
    if not _is_int(epoch, 1) or not isinstance(state["stopped"], bool):
        return (f"epoch and stopped must be an integer from 1 and true or false, not "
                f"{quoted(epoch)} and {quoted(state['stopped'])}")
    if state["initial_loss"] is not None and not _is_real(state["initial_loss"]):
        return f"initial_loss must be a number, not {quoted(state['initial_loss'])}"
    optimizer = state["optimizer"]
    return (weights_problem(state["net"], net, "net")
            or _optimizer_problem(optimizer, net)
            or _schedule_problem(state["schedule"], len(optimizer["param_groups"]))
            or _generator_problem(state["generator"], "generator")
            or _generator_problem(state["torch_rng"], "torch_rng")
            or _records_problem(state["history"], "history", history_fields)
            or _best_problem(state["best"], net, epoch)
            or next((problem for key, check in EXTRA_CHECKS.items()
                     if key in state and (problem := check(state[key], key))), None))


# ----------------------------------------------------------------------------- the latest


def _attempts(candidates: list[Found], check: StateCheck | None, fingerprint: dict | None
              ) -> Iterator[tuple[Found, dict | None, str | None]]:
    """The candidates newest first, each with its state or why it cannot be used (logged as a
    WARNING). One written by another training (check_resumable against `fingerprint`) is
    exit 2: an older one would be too."""
    for found in reversed(candidates):
        state, problem = None, found.problem
        if problem is None:
            if fingerprint is not None:
                check_resumable(found, fingerprint)
            try:
                state = load_torch_file(found.path / STATE)
            except TorchFileError as err:
                problem = f"{STATE}: {err}"
            else:
                problem = _state_problem(found, state, check)
        if problem is not None:
            LOG.warning("checkpoint %s is unusable (%s); trying the one before", found.path,
                        problem)
            state = None
        yield found, state, problem


def _state_problem(found: Found, state: Any, check: StateCheck | None) -> str | None:
    """`check`'s problem with a state, or its epoch's disagreeing with meta.json's."""
    problem = check(state) if check is not None else None
    epoch = state.get("epoch") if isinstance(state, dict) else None
    if problem is None and epoch != found.meta["epoch"]:
        problem = f"epoch {quoted(epoch)} is not meta.json's {found.meta['epoch']}"
    return None if problem is None else f"{STATE}'s {problem}"


def load_latest(candidates: list[Found], check: StateCheck | None = None,
                fingerprint: dict | None = None) -> tuple[Found, dict] | None:
    """The newest candidate that loads and passes `check` (an epoch loop's state_problem for
    its network), written by this training (`fingerprint`, when given); an older one where the
    newest cannot be used; None: none can."""
    for found, state, _ in _attempts(candidates, check, fingerprint):
        if state is not None:
            return found, state
    return None


def latest_single_run(root: Path, fingerprint: dict, check: StateCheck | None
                      ) -> tuple[Found, dict]:
    """--resume of a single run: the latest usable checkpoint of a single run in `root`,
    checked against this run (check_resumable); exit 2 saying why where there is none."""
    newest = None
    for found, state, problem in _attempts(of_single_runs(find_checkpoints(root)), check,
                                           fingerprint):
        if state is not None:
            return found, state
        newest = newest or f" (the latest, {found.path}: {problem})"
    raise ConfigError(f"--resume: {root} holds no usable checkpoint of a single run"
                      f"{newest or ''}", "drop --resume to start afresh, or give the "
                      "--checkpoint_dir of the run to continue")


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
    everything = find_checkpoints(root)
    for unusable in (f for f in everything if f.problem):  # no candidate can claim it
        LOG.warning("checkpoint %s is unusable (%s); passed over", unusable.path, unusable.problem)
    found = [f for f in everything if f.meta.get("search")]
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


def _listed(values: list, shown: int = 5) -> str:
    more = f" and {len(values) - shown} more" if len(values) > shown else ""
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values[:shown]) + more


def latest_of_candidate(root: Path, search: str, candidate: int, fingerprint: dict,
                        check: StateCheck | None) -> tuple[Found, dict] | None:
    """--resume: a search's candidate's latest usable checkpoint (any engine's), checked
    against the candidate's `fingerprint` and network (`check`); None (logged): it has none
    and starts afresh."""
    latest = load_latest([f for f in find_checkpoints(root)
                          if (f.meta.get("search") or {}).get("run") == search and
                          f.meta["search"]["candidate"] == candidate], check, fingerprint)
    if latest is None:
        LOG.info("candidate %d has no usable checkpoint: it starts afresh", candidate)
        return None
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
                          f"training ({key} {quoted(saved.get(key), 60)} there, "
                          f"{quoted(fingerprint.get(key), 60)} here)",
                          "resume with the flags and data of that run, or give a fresh "
                          "--checkpoint_dir")


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

    def start_state(self, check: StateCheck) -> dict | None:
        """The state to continue from (None: start afresh), checked against this run and the
        network it is loaded into (`check`): a single run's latest usable checkpoint; a
        candidate's own latest (none: it starts afresh)."""
        if not self.resume:
            return None
        if self.search is not None:
            latest = latest_of_candidate(self.root, self.search["run"], self.search["candidate"],
                                         self.fingerprint, check)
            if latest is None:
                return None
            self.resumed_from = int(latest[1]["epoch"])
            return latest[1]
        found, state = latest_single_run(self.root, self.fingerprint, check)
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
