"""--engine ray with a candidate search (--lr_candidates, --num_candidates): each candidate is a
Ray Tune trial, one training run of the local epoch loop in one process of --num_threads CPUs
(worker.train_trial), as many at once as the cluster holds (at most --num_workers when given);
each keeps its checkpoints in the run's folder and restarts from its latest after a lost
process. The winner is then picked here as a local search picks it: ttc/nets/candidates.py's
CandidateSearch.choose scores every trial's best weights with dspy.Evaluate on the validation
split (ties: the validation loss), skips the diverged ones and fails when all diverged.
With --resume each trial continues its candidate's latest checkpoint in the latest search of
the folder (ttc/nets/checkpoints.py latest_search), a local search's or a Ray one's.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ttc.distributed.launch import (MAX_FAILURES, RayRun, check_model_def, image_planner,
                                    new_ray_run, new_search, require_local_gpus, require_room,
                                    restore, runner_of, trained_of, worker_payload)
from ttc.distributed.worker import WorkerPayload, read_starts, train_trial
from ttc.inputs.data import Dataset
from ttc.nets.checkpoints import (StateCheck, latest_of_candidate, latest_search, read_state,
                                  search_key)
from ttc.nets.candidates import CandidateSearch, TrainedCandidate
from ttc.nets.finite import TrainingDiverged
from ttc.nets.image_loop import ImagePlan
from ttc.nets.training import TrainedModel, TrainingPlan, engine_section, plan_training
from ttc.serving.cluster import driving_ray
from utils import LOG, ConfigError, stdout_to_stderr

if TYPE_CHECKING:
    from ttc.options.stages import TrainingOptions


@dataclass
class Trials:
    """The search's candidates as the driver builds them (a student and a trainer each, which
    the trial's results are restored into) and what the trials reported."""

    students: list = field(default_factory=list)
    trainers: list = field(default_factory=list)
    overrides: list[dict] = field(default_factory=list)  # per trial: what it changes in base
    results: list = field(default_factory=list)  # ray.tune Results, by candidate
    at_once: int = 0
    seconds: float = 0.0


def search_on_ray(options: TrainingOptions, dataset: Dataset) -> TrainedModel:
    """The candidate search's training stage for --engine ray (a classifier's, a segmenter's
    or a detector's: the model type's own plan and CandidateSearch)."""
    plan = (image_planner(options.model_type) or plan_training)(options, dataset, engine="ray")
    search = new_search(plan, options.learning_rates(),
                        [options.seed + k for k in range(options.num_candidates)])
    ray_run = new_ray_run(options)
    trials, base = candidate_payloads(options, dataset, plan, search, ray_run)
    require_local_gpus(options.use_gpu, ray_run.options)
    with driving_ray(ray_run.options) as session:
        ray_run.address, ray_run.start_seconds = session.address, session.start_seconds
        run_trials(options, base, trials, ray_run)
    program = search.choose(trained_candidates(search, trials, options.epochs), base.devset)
    trained = trained_of(plan, program, search, dataset, options)
    trained.engine = search_engine_section(options, search, trials, ray_run)
    return trained


def candidate_payloads(options: TrainingOptions, dataset: Dataset, plan: TrainingPlan | ImagePlan,
                       search: CandidateSearch, ray_run: RayRun
                       ) -> tuple[Trials, WorkerPayload]:
    """Each candidate's student and trainer built as a local search builds them (the same
    seed, starting weights and torch random state), and the payload they share."""
    trials, base, searched = Trials(), None, ray_run.run
    for index, (learning_rate, seed) in enumerate(search.grid):
        trainer = plan.make_trainer(learning_rate, seed)
        student = plan.make_student(seed)
        torch_rng = torch.get_rng_state()  # what the local candidate's first epoch starts from
        if base is None:
            base = worker_payload(options, dataset, plan, student, trainer, torch_rng, ray_run)
            if options.resume:
                searched = latest_search(ray_run.folder, search.grid, base.fingerprint)
        trials.students.append(student)
        trials.trainers.append(trainer)
        fingerprint = {**base.fingerprint, "learning_rate": learning_rate, "seed": seed}
        trials.overrides.append({
            "trainer": trainer, "weights": student.net.state_dict(), "torch_rng": torch_rng,
            "run": f"{ray_run.run}-trial{index + 1}",
            "starts": str(ray_run.folder / f"search-{ray_run.run}" /
                          f"trial{index + 1}.starts"),
            "fingerprint": fingerprint,
            "meta": {"search": search_key(searched, index + 1, search.grid)},
            "resume_from": resumed_candidate(options, ray_run, search, index, searched,
                                             fingerprint, runner_of(plan).checkpoint_check(
                                                 student.net))})
    return trials, base


def resumed_candidate(options: TrainingOptions, ray_run: RayRun, search: CandidateSearch,
                      index: int, searched: str, fingerprint: dict, check: StateCheck) -> str | None:
    """--resume: the checkpoint candidate `index` continues from (its latest usable one in the
    search resumed, a local one or a trial's), checked against its fingerprint and network
    (`check`); None: it starts afresh."""
    if not options.resume:
        return None
    latest = latest_of_candidate(ray_run.folder, searched, index + 1, fingerprint, check)
    search.resumed_from[index] = None if latest is None else int(latest[1]["epoch"])
    if latest is None:
        return None
    return str(latest[0].path)


def run_trials(options: TrainingOptions, base: WorkerPayload, trials: Trials,
               ray_run: RayRun) -> None:
    """The Tuner: one trial per candidate, each of --num_threads CPUs (and a GPU with
    --use_gpu); trials.results in the candidates' order."""
    # Tune's own progress tables (the legacy reporter, silent at verbose=0; the new one
    # prints a table whatever the verbosity): the run logs the trials itself
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    import ray
    from ray import tune

    require_room(options.use_gpu, ray_run.options)
    shipped = ray.put(base)
    check_model_def(base, shipped)
    resources = {"cpu": base.threads, "gpu": 1 if options.use_gpu else 0}
    trials.at_once = trials_at_once(options, base.threads, len(trials.overrides))
    LOG.info("candidate search on Ray: %d trials, %d at once, of %d thread(s) each%s",
             len(trials.overrides), trials.at_once, base.threads,
             " and a GPU" if options.use_gpu else "")
    trainable = tune.with_resources(tune.with_parameters(
        train_trial, base=base, candidates=[ray.put(o) for o in trials.overrides]), resources)
    tuner = tune.Tuner(
        trainable, param_space={"candidate": tune.grid_search(list(range(len(trials.overrides))))},
        tune_config=tune.TuneConfig(max_concurrent_trials=options.num_workers,
                                    reuse_actors=True),  # no process start per trial
        run_config=tune.RunConfig(
            name=f"search-{ray_run.run}", storage_path=str(ray_run.folder), verbose=0,
            failure_config=tune.FailureConfig(max_failures=MAX_FAILURES),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=2)))
    started = time.perf_counter()
    with stdout_to_stderr():
        grid = tuner.fit()
    trials.seconds = round(time.perf_counter() - started, 3)
    for result in grid:
        if result.error is not None:
            raise result.error
    trials.results = sorted(grid, key=lambda result: result.config["candidate"])


def trials_at_once(options: TrainingOptions, threads: int, count: int) -> int:
    """How many trials the cluster runs at once: as many as its CPUs (GPUs) hold, at most
    --num_workers when given."""
    import ray

    resources = ray.cluster_resources()
    fit = int(resources.get("CPU", 0) // threads)
    if options.use_gpu:
        fit = min(fit, int(resources.get("GPU", 0)))
    if options.num_workers is not None:
        fit = min(fit, options.num_workers)
    return max(1, min(fit, count))


def trained_candidates(search: CandidateSearch, trials: Trials, epochs: int
                       ) -> list[TrainedCandidate]:
    """Each trial as CandidateSearch.choose takes it: its best weights in the driver's
    student, its history in its trainer, or the divergence that stopped it."""
    done = []
    for index, result in enumerate(trials.results):
        learning_rate, seed = search.grid[index]
        trainer, student = trials.trainers[index], trials.students[index]
        metrics = result.metrics or {}
        seconds = float(metrics.get("time_total_s") or 0.0)
        if metrics.get("diverged"):
            done.append(TrainedCandidate(index, trainer, None, seconds, diverged=TrainingDiverged(
                *metrics["diverged"], learning_rate, seed)))
            continue
        if result.checkpoint is None:
            raise ConfigError(f"the Ray trial of candidate {index + 1} reported no checkpoint",
                              "rerun with --log_level DEBUG")
        with result.checkpoint.as_directory() as folder:
            restore(student, trainer, read_state(Path(folder)))
        stopped = len(trainer.history) < epochs
        if stopped:
            LOG.info("trial %d of %d (learning rate %g, seed %d) stopped early after epoch %d "
                     "of %d (--patience)", index + 1, len(search.grid), learning_rate, seed,
                     len(trainer.history), epochs)
        starts = read_starts(Path(trials.overrides[index]["starts"]))
        done.append(TrainedCandidate(index, trainer, student, seconds, extra={
            "trial_seconds": round(seconds, 3), "epochs_run": len(trainer.history),
            "stopped_early": stopped, "restarts": max(0, len(starts) - 1)}))
    return done


def search_engine_section(options: TrainingOptions, search: CandidateSearch, trials: Trials,
                          ray_run: RayRun) -> dict:
    """train.engine for a search on Ray: the kept trial's epoch times, and the trials (how many
    at once, the search's wall time, the early-stopped)."""
    chosen = trials.trainers[search.chosen]
    return engine_section(
        "ray", ray_run.address, 1, ray_run.options.threads,
        [record.seconds for record in chosen.history], use_gpu=options.use_gpu,
        cluster_start_s=round(ray_run.start_seconds, 3), checkpoint_dir=str(ray_run.folder),
        resumed_from_epoch=search.resumed_from.get(search.chosen) if options.resume else None,
        max_failures=MAX_FAILURES,
        trials=len(search.grid), trials_at_once=trials.at_once,
        search_seconds=trials.seconds,
        stopped_early_trials=[c.index for c in search.candidates
                              if getattr(c, "stopped_early", False)],
        **({"candidates_resumed_from_epoch": search.resumed_epochs()} if options.resume
           else {}))
