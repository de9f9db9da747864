"""The candidate search: CandidateSearch (a DSPy Teleprompter that, like DSPy's random-search
optimizers, compiles one trainer per learning rate and seed, scores each compiled program with
dspy.Evaluate on the validation split and keeps the best; a diverged candidate is skipped) and
the rows it reports. A local search trains its candidates here one after the other; --engine
ray's trials (ttc/distributed/search.py) are scored by the same choose. Imports dspy.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import dspy
from dspy.teleprompt import Teleprompter

from ttc.nets.classifier_loop import WeightTrainer
from ttc.nets.dspy_program import ClassifierProgram
from ttc.nets.finite import TrainingDiverged, example_rate
from ttc.reporting.metrics import nll
from utils import LOG, TrainingError, raise_if_interrupted, stdout_to_stderr


@dataclass
class Candidate:
    """One trained candidate of the search and its validation figures."""

    index: int
    learning_rate: float
    seed: int
    val_accuracy: float  # dspy.Evaluate score on the validation split, as a fraction
    val_loss: float  # mean cross-entropy on the validation split (breaks accuracy ties)
    best_epoch: int
    seconds: float


@dataclass
class TrialCandidate(Candidate):
    """A candidate trained as a Ray Tune trial (ttc/distributed/search.py): what the engine
    adds to the report's row (a local search's rows keep Candidate's keys)."""

    trial_seconds: float | None = None  # the trial's own wall time, on its worker
    epochs_run: int | None = None
    stopped_early: bool | None = None  # the trial's early stopping ended it before --epochs
    restarts: int | None = None  # after a lost process, from the trial's last checkpoint


@dataclass
class TrainedCandidate:
    """One candidate's training as CandidateSearch.choose scores it: the compiled program and
    its trainer (history, best epoch), trained in this process or by a Ray Tune trial, or the
    TrainingDiverged that stopped it. `extra` is what a TrialCandidate adds to its row."""

    index: int
    trainer: WeightTrainer
    program: ClassifierProgram | None
    seconds: float  # its training's, before the search scores it
    diverged: TrainingDiverged | None = None
    extra: dict = field(default_factory=dict)


class CandidateSearch(Teleprompter):
    """Like DSPy's random-search optimizers, over weight training: compile one WeightTrainer per
    (learning rate, seed) candidate, score each compiled program with dspy.Evaluate on the
    validation set and keep the best. Ties go to the lower validation loss: small validation
    sets tie often, and the loss still tells the candidates apart. A candidate whose training
    diverges is skipped with a WARNING (`diverged`); the search fails only when all do.
    compile trains the candidates here, one after the other; choose scores candidates trained
    elsewhere too (--engine ray's parallel trials), by the same rules."""

    def __init__(self, metric: Callable, make_student: Callable[[int], ClassifierProgram],
                 make_trainer: Callable[[float, int], WeightTrainer],
                 learning_rates: Sequence[float], seeds: Sequence[int]) -> None:
        super().__init__()
        self.metric, self.make_student, self.make_trainer = metric, make_student, make_trainer
        self.grid = [(lr, seed) for lr in learning_rates for seed in seeds]
        self.candidates: list[Candidate] = []
        self.diverged: list[dict] = []  # candidates whose training diverged (skipped)
        self.chosen = 0
        self.chosen_trainer: WeightTrainer | None = None
        self.resumed_from: dict[int, int | None] = {}  # per candidate, with --resume

    score_name = "accuracy"  # what `score` measures, for the log

    def compile(self, student: ClassifierProgram | None = None, *, trainset: list[dspy.Example],
                teacher=None, valset: list[dspy.Example] | None = None,
                **kwargs) -> ClassifierProgram:
        devset = valset or trainset
        return self.choose(self._train_each(trainset, devset), devset)

    def _train_each(self, trainset: list[dspy.Example], devset: list[dspy.Example]
                    ) -> Iterator[TrainedCandidate]:
        """The candidates trained in turn (lazily: only the best program so far is kept)."""
        for index, (learning_rate, seed) in enumerate(self.grid):
            started = time.perf_counter()
            if len(self.grid) > 1:
                LOG.info("candidate %d of %d: learning rate %g, seed %d", index + 1,
                         len(self.grid), learning_rate, seed)
            trainer = self.make_trainer(learning_rate, seed)
            self.own_checkpoints(trainer, index)
            try:
                program = trainer.compile(self.make_student(seed), trainset=trainset,
                                          valset=devset)
            except TrainingDiverged as err:
                if len(self.grid) == 1:
                    raise
                yield TrainedCandidate(index, trainer, None, 0.0, diverged=err)
                continue
            finally:
                if trainer.checkpoints is not None:
                    self.resumed_from[index] = trainer.checkpoints.resumed_from
            yield TrainedCandidate(index, trainer, program, time.perf_counter() - started)

    def own_checkpoints(self, trainer, index: int) -> None:
        """A search's candidate keeps its own checkpoints (--checkpoint_dir: its run, its
        learning rate and seed in the fingerprint) and resumes its own (--resume)."""
        if trainer.checkpoints is not None and len(self.grid) > 1:
            learning_rate, seed = self.grid[index]
            trainer.checkpoints = trainer.checkpoints.for_candidate(index, learning_rate, seed,
                                                                    self.grid)

    def resumed_epochs(self) -> list[int | None] | None:
        """--resume with a search: the epoch each candidate continued from (None: it started
        afresh), in the grid's order; None without a search resumed."""
        if len(self.grid) == 1 or not self.resumed_from:
            return None
        return [self.resumed_from.get(index) for index in range(len(self.grid))]

    def choose(self, trained: Iterable[TrainedCandidate], devset: list[dspy.Example]
               ) -> ClassifierProgram:
        """Score each trained candidate (`score`), skip the diverged, keep the best: its
        program; TrainingError when every candidate diverged."""
        best: tuple[float, float] | None = None
        best_program = None
        for done in trained:
            if done.diverged is not None:
                self._skip(done.index, done.diverged)
                continue
            started = time.perf_counter()
            score, loss = self.score(done.program, done.trainer, devset)
            learning_rate, seed = self.grid[done.index]
            record = TrialCandidate if done.extra else Candidate
            self.candidates.append(record(
                done.index, learning_rate, seed, score, loss, done.trainer.best_epoch,
                round(done.seconds + time.perf_counter() - started, 3), **done.extra))
            if best is None or (score, -loss) > best:
                best, best_program = (score, -loss), done.program
                self.chosen, self.chosen_trainer = done.index, done.trainer
        if best_program is None:  # every candidate diverged
            self._all_diverged()
        if len(self.grid) > 1:
            chosen = self.chosen_candidate
            LOG.info("candidate search: kept %d of %d (learning rate %g, seed %d, val %s "
                     "%.4f)", chosen.index + 1, len(self.grid), chosen.learning_rate, chosen.seed,
                     self.score_name, chosen.val_accuracy)
        return best_program

    def _all_diverged(self) -> None:
        first = self.diverged[0]
        rates = ", ".join(f"{r:g}" for r in dict.fromkeys(d["learning_rate"]
                                                          for d in self.diverged))
        raise TrainingError(f"training diverged for all {len(self.grid)} candidates "
                            f"(learning rates {rates}); the first {first['reason']}",
                            "lower --lr_candidates (e.g. "
                            f"{example_rate(min(lr for lr, _ in self.grid))})")

    def score(self, program: ClassifierProgram, trainer: WeightTrainer,
              devset: list[dspy.Example]) -> tuple[float, float]:
        """(the compiled program's dspy.Evaluate score on the validation set, its validation
        loss)."""
        evaluate = dspy.Evaluate(devset=devset, metric=self.metric, num_threads=1,
                                 display_progress=False, max_errors=1)
        with stdout_to_stderr(), program.batched_for(devset):
            score = evaluate(program).score / 100.0
        raise_if_interrupted()
        return score, validation_loss(program, devset)

    @property
    def chosen_candidate(self) -> Candidate:
        return next(c for c in self.candidates if c.index == self.chosen)

    def _skip(self, index: int, err: TrainingDiverged) -> None:
        reason = (f"diverged at epoch {err.epoch}, batch {err.batch}: {err.what}")
        LOG.warning("candidate %d of %d (learning rate %g, seed %d) %s; skipped, the search "
                    "goes on", index + 1, len(self.grid), err.learning_rate, err.seed, reason)
        self.diverged.append({"index": index, "learning_rate": err.learning_rate,
                              "seed": err.seed, "reason": reason})


def validation_loss(program: ClassifierProgram, devset: list[dspy.Example]) -> float:
    x, y = WeightTrainer._stack(program, devset)
    return nll(program.predict_proba(x.numpy()), y.numpy())


class BestEpochSearch(CandidateSearch):
    """A search whose trainers keep their best epoch's validation record (the dense types' and
    a regressor's): a candidate is scored by that epoch's score and loss, its weights being the
    program's, with no second pass over the validation set."""

    def score(self, program: Any, trainer: Any, devset: list[dspy.Example]
              ) -> tuple[float, float]:
        record = trainer.best_record
        return record.val_accuracy, math.inf if record.val_loss is None else record.val_loss
