"""How the weights are fitted: each network's regularisation defaults reach it (and the flags
override them), max-norm holds, early stopping stops at its patience and keeps the best epoch,
the schedule follows the run's length, and the overfitting hint fires only on an overfit."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from conftest import assert_clean_failure, run_cli, topic_texts


def write_texts(folder, per_class=40, seed=0, noise=0.0):
    """topic_texts() as a headerless label<TAB>text TSV; `noise`: that share of the labels
    replaced by random ones (what a network can only memorise)."""
    rng = np.random.default_rng(seed + 100)
    labels = sorted({label for _, label in topic_texts(2)})
    rows = []
    for text, label in topic_texts(per_class, seed):
        if rng.random() < noise:
            label = labels[rng.integers(len(labels))]
        rows.append(f"{label}\t{text}\n")
    path = folder / "texts.tsv"
    path.write_text("".join(rows))
    return path


def train(tmp_path, data, *flags):
    out = tmp_path / "run"
    run = run_cli("train.py", "--model_type", "text_classifier", "--dataset_path", data,
                  "--label_column", "0", "--text_column", "1", "--output_model",
                  out / "model.onnx", "--report_json", out / "report.json", "--no_progress",
                  "true", "--calibrate", "none", *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads((out / "model.json").read_text()), json.loads(
        (out / "report.json").read_text()), out


def summary(stderr: str) -> dict[str, tuple[str, str]]:
    """The configuration summary's lines: flag → (its mark, "*" or " ", and its value)."""
    found = {}
    for line in stderr.splitlines():
        if match := re.match(r"^  ([* ]) (\w+)\s+= (.*)$", line):
            found[match.group(2)] = (match.group(1), match.group(3))
    return found


def rebuilt(manifest, out):
    """The trained network, rebuilt from the bundle as export.py does."""
    import torch

    from ttc.nets.models import build_model

    net = build_model(manifest["architecture"], manifest["preprocessing"])
    net.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    return net


def test_the_text_cnn_trains_with_kim_s_regularisation_and_the_summary_shows_it(tmp_path):
    import torch

    run, manifest, report, out = train(tmp_path, write_texts(tmp_path), "--arch", "cnn",
                                       "--epochs", "3", "--log_level", "DEBUG")
    training = manifest["training"]
    assert manifest["architecture"]["dropout"] == 0.5
    assert (training["dropout"], training["max_norm"], training["weight_decay"],
            training["label_smoothing"]) == (0.5, 3.0, 0.0, 0.0)
    assert "Kim 2014" in training["regularisation_source"]
    net = rebuilt(manifest, out)
    assert [m.p for m in net.modules() if isinstance(m, torch.nn.Dropout)] == [0.5]
    norms = net.classifier.weight.detach().norm(dim=1)
    assert float(norms.max()) <= 3.0 + 1e-5
    # the network's defaults are shown, and not starred as if the user had set them
    shown = summary(run.stderr)
    assert shown["dropout"] == (" ", "0.5") and shown["max_norm"] == (" ", "3.0")
    assert shown["weight_decay"] == (" ", "0.0") and shown["arch"] == ("*", "'cnn'")


def test_the_flags_override_the_network_s_defaults(tmp_path):
    import torch

    run, manifest, _, out = train(tmp_path, write_texts(tmp_path), "--arch", "cnn", "--epochs",
                                  "2", "--dropout", "0.25", "--max_norm", "0.05",
                                  "--weight_decay", "0.02", "--label_smoothing", "0.1")
    training = manifest["training"]
    assert (training["dropout"], training["max_norm"], training["weight_decay"],
            training["label_smoothing"]) == (0.25, 0.05, 0.02, 0.1)
    net = rebuilt(manifest, out)
    assert [m.p for m in net.modules() if isinstance(m, torch.nn.Dropout)] == [0.25]
    # a bound this tight binds: every output row sits at it after the last step
    norms = net.classifier.weight.detach().norm(dim=1)
    assert float(norms.max()) <= 0.05 + 1e-6 and float(norms.min()) > 0.049
    assert summary(run.stderr)["dropout"] == ("*", "0.25")


def test_the_transformer_and_the_mlp_take_their_own_defaults(tmp_path):
    _, manifest, _, _ = train(tmp_path, write_texts(tmp_path), "--arch", "transformer",
                              "--epochs", "1")
    assert (manifest["training"]["dropout"], manifest["training"]["weight_decay"],
            manifest["training"]["max_norm"]) == (0.1, 0.01, None)


@pytest.mark.parametrize("flags,message", [
    (["--dropout", "1.0"], "invalid --dropout 1.0"),
    (["--label_smoothing", "-0.1"], "invalid --label_smoothing -0.1"),
    (["--max_norm", "-3"], "invalid --max_norm -3.0"),
    (["--patience", "-1"], "invalid --patience -1"),
    (["--weight_decay", "-1"], "invalid --weight_decay -1.0"),
    (["--arch", "resnet18", "--dropout", "0.3"], "--arch resnet18 keeps its own"),
])
def test_bad_fitting_flags_are_exit_2_before_any_work(tmp_path, flags, message):
    run = run_cli("train.py", "--dataset_path", "builtin:digits", "--output_model",
                  tmp_path / "m" / "model.onnx", *flags)
    assert_clean_failure(run, 2, message)
    assert not (tmp_path / "m").exists()


def test_mc_dropout_refuses_a_network_whose_dropout_is_off(tmp_path):
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--dropout", "0",
                  "--iterative", "mc_dropout", "--output_model", tmp_path / "model.onnx")
    assert_clean_failure(run, 2, "--dropout 0 turns the network's dropout off")


def test_early_stopping_stops_at_its_patience_and_keeps_the_best_epoch(tmp_path):
    """Half the labels noise and no dropout: the validation accuracy peaks early and the loss
    turns up a few epochs later. The run stops `patience` epochs after its lowest validation
    loss, and the network it keeps is the best epoch's (by validation accuracy, an earlier one):
    its validation loss, computed again from the saved weights, is that epoch's."""
    data = write_texts(tmp_path, per_class=20, noise=0.5)
    _, manifest, report, out = train(tmp_path, data, "--epochs", "40", "--patience", "2",
                                     "--dropout", "0", "--learning_rate", "0.01")
    history = report["train"]["history"]
    losses = [epoch["val_loss"] for epoch in history]
    lowest = int(np.argmin(losses)) + 1
    assert len(history) == lowest + 2 < 40
    assert report["train"]["stopped_early"] is True
    assert report["train"]["epochs_not_run"] == 40 - len(history)
    best = report["train"]["best_epoch"]
    assert best < len(history)
    assert manifest["training"]["patience"] == 2

    import torch

    from config import Config
    from ttc.inputs.data import DataOptions, load_dataset
    from ttc.nets.dspy_program import split_logits
    from ttc.reporting.metrics import nll

    config = Config(model_type="text_classifier", dataset_path=str(data), label_column="0",
                    text_column="1")
    dataset = load_dataset(DataOptions.from_config(config),
                           preprocessing=manifest["preprocessing"], labels=manifest["labels"])
    logits = split_logits(rebuilt(manifest, out), dataset.val.x)
    loss = nll(torch.softmax(torch.from_numpy(logits).double(), 1).numpy(), dataset.val.y)
    assert loss == pytest.approx(history[best - 1]["val_loss"], rel=1e-4)
    assert loss != pytest.approx(history[-1]["val_loss"], rel=1e-3)


def test_patience_0_trains_every_epoch(tmp_path):
    data = write_texts(tmp_path, per_class=30, noise=0.4)
    _, _, report, _ = train(tmp_path, data, "--epochs", "12", "--patience", "0",
                            "--dropout", "0", "--learning_rate", "0.01")
    assert report["train"]["epochs_run"] == 12 and report["train"]["stopped_early"] is False


def test_the_schedule_follows_the_run_s_length():
    """auto: a short run warms up over a few steps and is at its peak rate most of the time; a
    long one warms up over more steps; both decay to about 0 at the end."""
    from ttc.nets.fitting import warmup_stable_decay

    for steps in (100, 2000):
        factor = warmup_stable_decay(steps)
        rates = np.array([factor(s) for s in range(steps)])
        warmup = int(np.argmax(rates >= 1.0))
        assert warmup == round(0.05 * steps) - 1
        assert rates[0] == pytest.approx(1 / round(0.05 * steps))
        assert (rates == 1.0).mean() >= 0.74
        assert rates[-1] <= 1 / (0.2 * steps) + 1e-9
        assert np.all(np.diff(rates[warmup:]) <= 1e-12)


def test_the_overfit_hint_fires_on_an_overfit_run_and_not_on_a_good_one(tmp_path):
    noisy = write_texts(tmp_path, per_class=30, noise=0.5)
    run, _, report, _ = train(tmp_path, noisy, "--epochs", "30", "--patience", "0",
                              "--dropout", "0", "--learning_rate", "0.01")
    health = report["train"]["health"]
    assert health["overfit_gap"] > 0.10
    assert "the network overfits" in health["hint"] and "--dropout (now 0)" in health["hint"]
    assert "WARNING" in run.stderr and "the network overfits" in run.stderr
    (tmp_path / "run").rename(tmp_path / "noisy")
    clean = write_texts(tmp_path, per_class=40)
    # every row trained on: on 120 texts a calibration slice's 12 fewer move the gap by a point
    run, _, report, _ = train(tmp_path, clean, "--epochs", "10", "--calibration_fraction", "0")
    assert report["train"]["health"]["overfit_gap"] <= 0.10
    assert report["train"]["health"]["hint"] is None
    assert "overfits" not in run.stderr


def test_every_network_s_dropout_default_reaches_its_layers():
    """The defaults in ttc/tasks are the rates the built networks' Dropout layers have."""
    import torch

    from ttc.nets.models import architecture_for, build_model
    from ttc.tasks.registry import TASKS

    # a small preprocessing record per input, the kind each type's own (its networks read the
    # sizes they need), so that a new type is checked without a line here
    sizes = {"image": {"image_size": [32, 32], "channels": 1, "ignore_index": 255},
             "text": {"vocab_size": 50, "max_length": 16},
             "feature": {"feature_names": ["a", "b"]}}
    checked: list[tuple[str, str]] = []
    for task in TASKS:
        record_in = {**sizes[task.input_role], "kind": task.kind}
        for arch, defaults in task.regularisation.items():
            if defaults.dropout is None:
                continue
            for wanted in (None, 0.35):
                record = architecture_for(record_in, 3, arch, dropout=wanted)
                rates = {m.p for m in build_model(record, record_in).modules()
                         if isinstance(m, torch.nn.Dropout)}
                assert rates == {defaults.dropout if wanted is None else wanted}, (task.name,
                                                                                   arch)
            checked.append((task.name, arch))
    assert ("image_classifier", "small_cnn") in checked and len(checked) >= len(TASKS)
