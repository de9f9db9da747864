"""Training on Ray Train (`pipeline.py` / `train.py --engine ray`) against a local run: on the
test worker's running head node (conftest's ray_cluster, joined by --ray_address), and on a
local cluster of this machine's CPUs that the run starts and stops (the worker killed mid-epoch);
and the training checkpoints (--checkpoint_dir, --resume) a local run keeps. The tests share the
Ray tests' xdist worker: two clusters at once would not fit on two cores."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import CLI_ENV, REPO, assert_clean_failure, descendants, run_cli

pytestmark = pytest.mark.xdist_group("ray")

DIGITS = ["--dataset_path", "builtin:digits", "--epochs", "2", "--no_progress", "true",
          "--num_threads", "1"]


def weights(bundle: Path) -> dict:
    return torch.load(bundle / "model.pt", weights_only=True)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def train(out: Path, *args: str) -> dict:
    """train.py into out/model.onnx; it must exit 0. Its report."""
    run = run_cli("train.py", *DIGITS, "--output_model", out / "model.onnx", "--report_json",
                  out / "report.json", *args)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def test_one_ray_worker_trains_the_local_run_s_weights(ray_cluster, tmp_path):
    """Same seed, one worker: the epoch loop on the worker is the local one (EpochRunner), with
    the driver's starting weights and random state, so the weights agree to float noise."""
    local = train(tmp_path / "local")
    ray = train(tmp_path / "ray", "--engine", "ray", "--num_workers", "1", "--ray_address",
                ray_cluster)
    assert max_difference(weights(tmp_path / "local"), weights(tmp_path / "ray")) <= 1e-5
    engine = ray["train"]["engine"]
    assert engine["engine"] == "ray" and engine["workers"] == 1
    assert [h["epoch"] for h in ray["train"]["history"]] == [1, 2]
    assert ray["train"]["val_accuracy"] == pytest.approx(local["train"]["val_accuracy"])
    assert local["train"]["engine"]["engine"] == "local"
    checkpoints = list((tmp_path / "ray" / "model.checkpoints").rglob("state.pt"))
    assert checkpoints, "a Ray run keeps its checkpoints beside the bundle"


def test_a_local_run_resumes_from_its_last_checkpoint(tmp_path):
    """A 3-epoch run whose last checkpoint is lost (as if killed in epoch 3) resumes from epoch
    2's: the same weights as the whole run, and each epoch once in the history."""
    whole = train(tmp_path / "whole", "--epochs", "3", "--checkpoint_dir", tmp_path / "ck")
    [third] = list((tmp_path / "ck").glob("local-*/epoch-0003"))
    shutil.rmtree(third)
    resumed = train(tmp_path / "resumed", "--epochs", "3", "--checkpoint_dir", tmp_path / "ck",
                    "--resume", "true")
    assert [h["epoch"] for h in resumed["train"]["history"]] == [1, 2, 3]
    assert resumed["train"]["engine"]["resumed_from_epoch"] == 2
    assert resumed["train"]["history"][:2] == whole["train"]["history"][:2]
    assert max_difference(weights(tmp_path / "whole"), weights(tmp_path / "resumed")) <= 1e-6
    more = train(tmp_path / "more", "--epochs", "4", "--checkpoint_dir", tmp_path / "ck",
                 "--resume", "true")  # a longer run continues the finished one
    assert [h["epoch"] for h in more["train"]["history"]] == [1, 2, 3, 4]


def test_a_local_search_resumes_each_candidate_from_its_own_checkpoint(tmp_path):
    """A 2-candidate search whose second candidate lost its last checkpoint (as if killed in
    its epoch 2): the first is restored as it finished, the second continues from epoch 1;
    the same winner and weights, each epoch once. Another grid of learning rates is refused."""
    search, ck = ["--lr_candidates", "1e-3,3e-3"], ["--checkpoint_dir", tmp_path / "ck"]
    whole = train(tmp_path / "whole", *search, *ck)["train"]
    second = [f for f in (tmp_path / "ck").glob("local-*-cand2/epoch-0002")]
    assert len(second) == 1 and len(list((tmp_path / "ck").glob("local-*-cand1"))) == 1
    shutil.rmtree(second[0])
    resumed = train(tmp_path / "resumed", *search, *ck, "--resume", "true")["train"]
    assert resumed["chosen_candidate"] == whole["chosen_candidate"]
    assert resumed["engine"]["candidates_resumed_from_epoch"] == [2, 1]
    assert [(c["index"], c["best_epoch"]) for c in resumed["candidates"]] == \
        [(c["index"], c["best_epoch"]) for c in whole["candidates"]]
    assert [h["epoch"] for h in resumed["history"]] == [1, 2]
    assert max_difference(weights(tmp_path / "whole"), weights(tmp_path / "resumed")) <= 1e-6
    other = run_cli("train.py", *DIGITS, "--output_model", tmp_path / "other" / "model.onnx",
                    "--lr_candidates", "1e-3,1e-2", *ck, "--resume", "true")
    assert_clean_failure(other, 2, "learning rates 0.001,0.003 there, 0.001,0.01 here")


def test_the_parallel_search_keeps_the_sequential_search_s_winner(ray_cluster, tmp_path):
    """Three candidates, one of which diverges (1e6: NaN in epoch 1): as Ray Tune trials
    (one process each, two at once here) the same candidates are trained, skipped and scored as
    by the local search one after the other, and the same one is kept. Resumed for a third
    epoch, each trial continues its own checkpoint (the diverged one, without any, afresh)."""
    search = ["--lr_candidates", "1e-3,1e6,3e-3"]
    local = train(tmp_path / "local", *search)["train"]
    on_ray = ["--engine", "ray", "--ray_address", ray_cluster]
    ray = train(tmp_path / "ray", *search, *on_ray)["train"]
    assert (ray["learning_rate"], ray["seed"], ray["chosen_candidate"]) == \
        (local["learning_rate"], local["seed"], local["chosen_candidate"])
    assert [(d["index"], d["learning_rate"]) for d in ray["diverged_candidates"]] == \
        [(d["index"], d["learning_rate"]) for d in local["diverged_candidates"]] == [(1, 1e6)]
    assert [(c["index"], c["best_epoch"]) for c in ray["candidates"]] == \
        [(c["index"], c["best_epoch"]) for c in local["candidates"]]
    assert [c["index"] for c in ray["candidates"]] == [0, 2]
    for mine, theirs in zip(ray["candidates"], local["candidates"]):  # one validation image
        assert mine["val_accuracy"] == pytest.approx(theirs["val_accuracy"], abs=0.004)
        assert mine["epochs_run"] == 2 and mine["stopped_early"] is False
        assert mine["trial_seconds"] > 0 and mine["restarts"] == 0
        assert "trial_seconds" not in theirs  # a local search's rows are as before
    assert [h["epoch"] for h in ray["history"]] == [1, 2]
    engine = ray["engine"]
    assert engine["engine"] == "ray" and engine["trials"] == 3 and engine["trials_at_once"] >= 1
    assert engine["stopped_early_trials"] == []
    more = train(tmp_path / "ray", *search, *on_ray, "--epochs", "3", "--resume",
                 "true")["train"]  # each trial from its checkpoint; the diverged one afresh
    assert more["engine"]["candidates_resumed_from_epoch"] == [2, None, 2]
    assert [h["epoch"] for h in more["history"]] == [1, 2, 3]
    assert [c["epochs_run"] for c in more["candidates"]] == [3, 3]


class Stored:
    """A Ray result's checkpoint as search.trained_candidates reads it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @contextlib.contextmanager
    def as_directory(self):
        yield str(self.folder)


def test_a_trial_s_early_stop_and_divergence_reach_the_search(tmp_path):
    """Without a cluster: a trial that stopped early (1 of 3 epochs) is restored into its
    student and trainer and marked stopped_early; a diverged one becomes the TrainingDiverged
    that CandidateSearch skips."""
    from types import SimpleNamespace

    from ttc.distributed.search import Trials, trained_candidates
    from ttc.nets.checkpoints import write_checkpoint
    from ttc.nets.candidates import CandidateSearch
    from ttc.nets.dspy_program import ClassifierProgram, label_match

    net = torch.nn.Linear(4, 2)
    record = {"epoch": 1, "loss": 0.5, "train_accuracy": 0.8, "val_accuracy": 0.9,
              "seconds": 0.1, "val_loss": 0.4}
    write_checkpoint(tmp_path / "ck", {"best": {"state": net.state_dict(), "epoch": 1},
                                       "history": [record], "initial_loss": 0.7}, {})
    search = CandidateSearch(label_match, None, None, [1e-3, 1e6], [0])
    trials = Trials(students=[ClassifierProgram(torch.nn.Linear(4, 2), ["a", "b"], "x")] * 2,
                    trainers=[SimpleNamespace(learning_rate=lr, seed=0) for lr in (1e-3, 1e6)],
                    overrides=[{"starts": str(tmp_path / "none.starts")}] * 2,
                    results=[SimpleNamespace(metrics={"time_total_s": 2.5},
                                             checkpoint=Stored(tmp_path / "ck")),
                             SimpleNamespace(metrics={"diverged": [1, 7, "the loss became nan"]},
                                             checkpoint=None)])
    stopped, diverged = trained_candidates(search, trials, epochs=3)
    assert stopped.extra == {"trial_seconds": 2.5, "epochs_run": 1, "stopped_early": True,
                             "restarts": 0}
    assert stopped.trainer.best_epoch == 1 and stopped.trainer.initial_loss == 0.7
    assert max_difference(stopped.program.net.state_dict(), net.state_dict()) == 0
    assert diverged.program is None and (diverged.diverged.epoch, diverged.diverged.batch,
                                         diverged.diverged.learning_rate) == (1, 7, 1e6)


def train_workers(pid: int) -> set[int]:
    """The Ray Train worker processes below `pid` (Ray titles them by their actor class)."""
    return {p for p, command in descendants(pid).items() if "RayTrainWorker" in command}


def checkpointed_epoch(folder: Path) -> int:
    """The latest epoch a checkpoint under `folder` holds (0: none yet)."""
    epochs = [0]
    for meta in folder.rglob("meta.json"):
        try:
            epochs.append(int(json.loads(meta.read_text())["epoch"]))
        except (OSError, ValueError, KeyError):
            continue
    return max(epochs)


def test_two_workers_train_export_and_survive_a_worker_killed_mid_epoch(tmp_path):
    """Two workers through pipeline.py; once a checkpoint is written and at least two epochs
    remain, a worker is SIGKILLed (in the next epoch's training or validation): Ray Train
    restarts both from the checkpoint, and the run trains, exports and evaluates as a local
    one. Killing only then (not on a timer) keeps the test free of races: a run that got too
    far before the kill fails the test's own assertion, not the run's."""
    out, epochs = tmp_path / "killed", 6
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "pipeline.py"), *DIGITS, "--epochs", str(epochs),
         "--batch_size", "16", "--engine", "ray", "--num_workers", "2", "--output_model",
         str(out / "model.onnx"), "--report_json", str(out / "report.json")],
        cwd=REPO, env=dict(os.environ, **CLI_ENV), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    killed_after, done, pids, deadline = None, 0, set(), time.time() + 240
    while killed_after is None and proc.poll() is None and time.time() < deadline:
        done = checkpointed_epoch(out / "model.checkpoints")
        if done > epochs - 2:
            break  # too late to be sure that a whole epoch remains
        pids = train_workers(proc.pid) if done else set()
        if pids:
            os.kill(min(pids), signal.SIGKILL)
            killed_after = done
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=300)
    assert killed_after is not None, (f"no worker was killed with two epochs still to run "
                                      f"(checkpointed epoch {done}, workers {pids}, exit "
                                      f"{proc.returncode})", stderr[-2000:])
    assert proc.returncode == 0, stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    train_section = report["train"]
    assert [h["epoch"] for h in train_section["history"]] == list(range(1, epochs + 1))
    engine = train_section["engine"]
    assert engine["restarts"] >= 1, (engine, killed_after, stderr[-2000:])
    # the checkpoint seen, or the one before it where the kill cut its copy short
    assert engine["restarted_from_epochs"][0] >= killed_after - 1, engine
    assert report["status"] == "ok" and engine["workers"] == 2
    # each worker held only its half of the training rows (the stacked 8x8 digits)
    train_rows = report["dataset"]["train"]
    assert sorted(engine["shard_rows"]) == [train_rows // 2, train_rows - train_rows // 2]
    assert engine["shard_bytes"] == [rows * (64 * 4 + 8) for rows in engine["shard_rows"]]
    assert len(engine["epoch_seconds"]) == len(engine["allreduce_seconds"]) == epochs
    assert 0 < engine["allreduce_share"] < 1
    assert report["export"]["max_abs_diff"] is not None and (out / "model.onnx").is_file()
    assert report["inference"]["accuracy"] > 0.8


MODEL_DEF = '''import sys
from torch import nn

if sys.argv and sys.argv[0].endswith("default_worker.py"):  # a Ray worker's process
    raise ImportError("No module named 'site_helpers' (installed on the driver's machine only)")


def build(num_classes, input_spec):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))
'''


def bad_inputs(tmp_path: Path, cluster: str) -> list[tuple[list, int, str]]:
    """The cases; the one found on the workers, on the running `cluster`."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "net.py").write_text(MODEL_DEF)
    out = str(tmp_path / "bad" / "model.onnx")
    cases = [
        (["--engine", "ray", "--ray_address", "127.0.0.1:1"], 5, "no Ray cluster answers"),
        (["--engine", "ray", "--num_workers", "64"], 2, "--num_workers 64"),
        (["--use_gpu", "true"], 2, "--use_gpu applies only to --engine ray"),
        (["--lr_candidates", "1e-3,3e-3", "--resume", "true", "--checkpoint_dir",
          str(tmp_path / "empty")], 2, "holds no checkpoint"),
        (["--engine", "ray", "--device", "cuda"], 2, "replace --device with --use_gpu"),
        (["--resume", "true", "--checkpoint_dir", str(tmp_path / "empty")], 2,
         "holds no checkpoint"),
        (["--checkpoint_dir", out], 2, "is the same path as --output_model"),
        (["--engine", "ray", "--num_workers", "1", "--model_def", f"{tmp_path / 'net.py'}:build",
          "--ray_address", cluster], 2, "cannot be built on the Ray workers"),
    ]
    if torch.cuda.device_count() == 0:
        cases.append((["--engine", "ray", "--num_workers", "1", "--use_gpu", "true"], 2,
                      "need a GPU each"))
        cases.append((["--model_type", "image_segmenter", "--dataset_path",
                       "builtin:digit_canvases", "--engine", "ray", "--num_workers", "1",
                       "--use_gpu", "true"], 2, "need a GPU each"))
    return [(case, code, phrase) for case, code, phrase in cases]


def test_bad_input_is_one_line_and_its_exit_code(ray_cluster, tmp_path):
    """Each before training starts (the model_def one once the cluster is up), one error line,
    no traceback, no bundle."""
    for args, code, phrase in bad_inputs(tmp_path, ray_cluster):
        run = run_cli("train.py", *DIGITS, "--output_model", tmp_path / "bad" / "model.onnx",
                      *args)
        assert_clean_failure(run, code, phrase)
        assert not (tmp_path / "bad" / "model.pt").exists(), args
