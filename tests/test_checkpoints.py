"""--resume on checkpoints edited or damaged after they were written (issue 61, L and M): every
checkpoint's meta.json and state.pt is checked (schema; the network's keys, shapes and dtypes;
the optimiser's state; the generators) before anything in it is used. An unusable latest
checkpoint is passed over with a WARNING for the one before; none usable is exit 2 in one short
line saying why. A tiny wine run keeps two checkpoints; each test edits a copy of them."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import assert_clean_failure, deflate_in_place, run_cli

WINE = ["--model_type", "tabular_classifier", "--dataset_path", "builtin:wine", "--no_progress",
        "true", "--num_threads", "1"]
Edit = Callable[[dict, dict], None]  # changes a checkpoint's meta.json and state.pt
Damage = Callable[[Path], None]  # changes a checkpoint's folder on disk


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """A 2-epoch wine run's checkpoint folder (epoch-0001 and epoch-0002 of one run)."""
    out = tmp_path_factory.mktemp("checkpoints")
    run = run_cli("train.py", *WINE, "--epochs", "2", "--output_model", out / "m" / "model.onnx",
                  "--checkpoint_dir", out / "ck")
    assert run.returncode == 0, run.stderr[-3000:]
    return out / "ck"


def edited(checkpoints: Path, folder: Path, edit: Edit | None = None,
           damage: Damage | None = None, every: bool = False) -> list[Path]:
    """A copy of the checkpoints in `folder`, the latest (or every one) edited or damaged;
    their folders, oldest first."""
    shutil.copytree(checkpoints, folder)
    epochs = sorted(folder.glob("local-*/epoch-*"))
    for path in epochs if every else epochs[-1:]:
        if edit is not None:
            meta = json.loads((path / "meta.json").read_text())
            state = torch.load(path / "state.pt", weights_only=True)
            edit(meta, state)
            (path / "meta.json").write_text(json.dumps(meta))
            torch.save(state, path / "state.pt")
        if damage is not None:
            damage(path)
    return epochs


def resume(folder: Path, out: Path, *args: object):
    return run_cli("train.py", *WINE, "--epochs", "3", "--checkpoint_dir", folder, "--resume",
                   "true", "--output_model", out / "model.onnx", "--report_json",
                   out / "report.json", *args)


def recompressed(folder: Path) -> None:
    """The checkpoint's state.pt with its entries deflated (torch.save stores them): a ZIP that
    inflates."""
    path = folder / "state.pt"
    deflate_in_place(path)


def nested(folder: Path) -> None:
    (folder / "meta.json").write_text("[" * 50_000 + "]" * 50_000)


FALLBACKS: dict[str, tuple[Edit | None, Damage | None, str]] = {
    "meta epoch as text": (lambda m, s: m.update(epoch="2"), None,
                           "meta.json's epoch must be an integer"),
    "meta search as a list": (lambda m, s: m.update(search=[1, 2]), None,
                              "meta.json's search must be an object"),
    "optimizer state of integers": (
        lambda m, s: s["optimizer"]["state"][0].update(
            exp_avg=torch.zeros_like(s["optimizer"]["state"][0]["exp_avg"], dtype=torch.int64)),
        None, "state.pt's optimizer.state[0]['exp_avg']"),
    "torch random state of floats": (lambda m, s: s.update(torch_rng=torch.zeros(5056)), None,
                                     "state.pt's torch_rng is [5056] torch.float32"),
    "state compressed to inflate": (None, recompressed, "entries are compressed, inflating to"),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_an_unusable_latest_checkpoint_falls_back_to_the_one_before(case, checkpoints,
                                                                    tmp_path):
    edit, damage, reason = FALLBACKS[case]
    epochs = edited(checkpoints, tmp_path / "ck", edit, damage)
    run = resume(tmp_path / "ck", tmp_path / "out")
    assert run.returncode == 0, run.stderr[-3000:]
    warning = next(line for line in run.stderr.splitlines() if "WARNING" in line)
    assert str(epochs[-1]) in warning and reason in warning and "the one before" in warning
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["train"]["engine"]["resumed_from_epoch"] == 1
    assert [h["epoch"] for h in report["train"]["history"]] == [1, 2, 3]


REFUSALS: dict[str, tuple[Edit, str]] = {
    "weights of another dtype": (
        lambda m, s: s["net"].update({"classifier.weight": s["net"][
            "classifier.weight"].double()}),
        "state.pt's net['classifier.weight'] is [3, 64] torch.float64, the network's [3, 64] "
        "torch.float32"),
    "best weights of another network": (
        lambda m, s: s["best"].update(state={"conv.weight": torch.zeros(8, 1, 3, 3)}),
        "state.pt's best.state lacks the network's"),
    "a schedule for two groups": (
        lambda m, s: s["schedule"].update(_last_lr=[0.1, 0.1]),
        "state.pt's schedule must hold"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_no_usable_checkpoint_is_one_short_line_and_exit_2(case, checkpoints, tmp_path):
    edit, reason = REFUSALS[case]
    epochs = edited(checkpoints, tmp_path / "ck", edit, every=True)
    run = resume(tmp_path / "ck", tmp_path / "out")
    assert_clean_failure(run, 2, "holds no usable checkpoint of a single run", str(epochs[-1]),
                         reason)
    assert not (tmp_path / "out" / "model.onnx").exists()


def test_a_huge_value_in_a_checkpoint_is_quoted_short(checkpoints, tmp_path):
    """The refusal quotes a few characters of the checkpoint's value, not the megabyte."""
    edited(checkpoints, tmp_path / "ck", lambda m, s: m["fingerprint"].update(
        network="resmlp" + "x" * 1_000_000))
    run = resume(tmp_path / "ck", tmp_path / "out")
    assert_clean_failure(run, 2, "was written by another training (network 'resmlpxxx",
                         "'mlp' here")
    assert len(run.error_lines()[0]) < 1000


def test_a_meta_json_nested_too_deep_is_exit_2(checkpoints, tmp_path):
    edited(checkpoints, tmp_path / "ck", damage=nested, every=True)
    assert_clean_failure(resume(tmp_path / "ck", tmp_path / "out"), 2, "holds no checkpoint")


def test_a_search_candidate_s_unusable_checkpoint_falls_back(tmp_path):
    """A candidate of a 2-candidate search whose latest state holds a history of text resumes
    from its checkpoint before; the other from its latest."""
    search = ["--lr_candidates", "1e-3,3e-3", "--checkpoint_dir", tmp_path / "ck"]
    first = run_cli("train.py", *WINE, *search, "--epochs", "2", "--output_model",
                    tmp_path / "a" / "model.onnx")
    assert first.returncode == 0, first.stderr[-3000:]
    latest = sorted((tmp_path / "ck").glob("local-*-cand2/epoch-*"))[-1]
    state = torch.load(latest / "state.pt", weights_only=True)
    state["history"] = "epoch 1, epoch 2"
    torch.save(state, latest / "state.pt")
    run = resume(tmp_path / "ck", tmp_path / "out", "--lr_candidates", "1e-3,3e-3")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"checkpoint {latest} is unusable (state.pt's history must be a list" in run.stderr
    engine = json.loads((tmp_path / "out" / "report.json").read_text())["train"]["engine"]
    assert engine["candidates_resumed_from_epoch"] == [2, 1]
