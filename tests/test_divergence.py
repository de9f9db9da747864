"""Training that diverges, and data that would look like it (issue #17, item 4).

A NaN or infinite loss or weights stop training at once with exit 4 and the advice to lower the
learning rate; a candidate search skips a diverged candidate and goes on; an infinite feature
value (`inf`, `1e400`, a number beyond float32) is a data error (exit 3) before any training; and
the export's numeric check never answers non-finite outputs with "raise --validate_atol".
"""
from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import assert_clean_failure, feature_rows, run_cli, topic_texts

FAST = ["--no_progress", "true", "--num_threads", "1"]
TOLERANCE_ADVICE = "raise --validate_atol"


def write_texts(path):
    path.write_text("text,label\n" + "".join(f'"{t}",{label}\n' for t, label in topic_texts()))
    return path


def write_features(path, bad_cell: str | None = None, every: int = 8, rows=None) -> object:
    """feature_rows() as a CSV; with `bad_cell`, the weight of every `every`-th row replaced."""
    rows = rows if rows is not None else feature_rows()
    lines = []
    for i, row in enumerate(rows):
        cells = dict(row)
        if bad_cell is not None and i % every == 0:
            cells["weight"] = bad_cell
        lines.append(",".join(cells.values()))
    path.write_text("height,weight,color,kind\n" + "\n".join(lines) + "\n")
    return path


def bundle_files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".onnx", ".pt", ".json"))


# ----------------------------------------------------------------------------- divergence


def test_diverging_training_stops_with_exit_4_and_writes_no_bundle(tmp_path):
    """builtin:digits at learning rate 1e6: the loss is NaN within the first epoch (measured:
    epoch 1, batch 8). Before, the run trained on to the end and the export blamed the
    tolerance ("... by nan > --validate_atol ...; raise --validate_atol, or report it")."""
    out = tmp_path / "bundle"
    out.mkdir()
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--epochs", "2",
                  "--learning_rate", "1e6", "--output_model", out / "model.onnx",
                  "--report_json", tmp_path / "report.json", *FAST)
    assert_clean_failure(run, 4, "training diverged at epoch 1, batch ", "became nan",
                         "(learning rate 1e+06, seed 0)", "lower --learning_rate (e.g. 1e-3)")
    assert TOLERANCE_ADVICE not in run.stderr
    assert bundle_files(out) == []
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "error" and report["error"]["code"] == 4


@pytest.mark.parametrize("model_type, dataset, phrase", [
    # the loss of the text model overflows to NaN in epoch 2 (epoch 1: loss 1e28, finite)
    ("text_classifier", "texts.csv", "the loss became nan"),
    # the tabular MLP's BatchNorm statistics overflow first: the per-epoch weights check
    ("tabular_classifier", "builtin:iris", "the weights became non-finite (in body."),
])
def test_divergence_is_caught_for_text_and_tabular_models(tmp_path, model_type, dataset, phrase):
    if dataset.endswith(".csv"):
        dataset = write_texts(tmp_path / dataset)
    run = run_cli("train.py", "--model_type", model_type, "--dataset_path", dataset,
                  "--epochs", "2", "--learning_rate", "1e10", "--output_model",
                  tmp_path / "model.onnx", *FAST)
    assert_clean_failure(run, 4, "training diverged at epoch ", phrase,
                         "(learning rate 1e+10, seed 0)", "lower --learning_rate (e.g. 1e-3)")
    assert bundle_files(tmp_path) == []


def test_candidate_search_skips_a_diverged_candidate(tmp_path):
    report_path = tmp_path / "report.json"
    run = run_cli("train.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:iris", "--epochs", "2", "--lr_candidates", "1e10,3e-2",
                  "--output_model", tmp_path / "model.onnx", "--report_json", report_path,
                  *FAST)
    assert run.returncode == 0, run.stderr[-3000:]
    warning = [line for line in run.stderr.splitlines() if "WARNING" in line and "diverged" in line]
    assert len(warning) == 1 and "candidate 1 of 2 (learning rate 1e+10, seed 0) diverged at " \
        "epoch 1" in warning[0] and "skipped" in warning[0], run.stderr[-3000:]
    train = json.loads(report_path.read_text())["train"]
    assert [c["learning_rate"] for c in train["candidates"]] == [3e-2]
    assert train["chosen_candidate"] == 1 and train["learning_rate"] == 3e-2
    assert [(d["index"], d["learning_rate"]) for d in train["diverged_candidates"]] == [(0, 1e10)]
    assert train["diverged_candidates"][0]["reason"].startswith("diverged at epoch 1, batch ")
    assert bundle_files(tmp_path) == ["model.json", "model.pt", "report.json"]


def test_candidate_search_fails_when_every_candidate_diverged(tmp_path):
    run = run_cli("train.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:iris", "--epochs", "2", "--lr_candidates", "1e10,1e12",
                  "--output_model", tmp_path / "model.onnx", *FAST)
    assert_clean_failure(run, 4, "training diverged for all 2 candidates (learning rates 1e+10, "
                         "1e+12); the first diverged at epoch 1", "lower --lr_candidates (e.g. 1e-3)")
    assert run.stderr.count("skipped, the search goes on") == 2
    assert bundle_files(tmp_path) == []


# ----------------------------------------------------------------------------- infinite data


@pytest.mark.parametrize("cell", ["inf", "-inf", "1e400", "1e39"])
def test_infinite_feature_values_are_a_data_error_not_divergence(tmp_path, cell):
    """`inf`/`-inf` parse as infinity, `1e400` overflows float64 and `1e39` float32: each used
    to reach the network as inf, making the training loss NaN from the first batch (and the
    export then blamed the tolerance). Now the run stops before training, exit 3."""
    data = write_features(tmp_path / "rows.csv", cell)
    run = run_cli("train.py", "--model_type", "tabular_classifier", "--dataset_path", data,
                  "--label_column", "kind", "--epochs", "2", "--output_model",
                  tmp_path / "model.onnx", *FAST)
    assert_clean_failure(run, 3, "rows hold an infinite value", "in the numeric column(s) "
                         "'weight'", "in the train split", "rows.csv row ",
                         "remove those rows, or empty those cells")
    assert "diverged" not in run.stderr and "epoch 1/" not in run.stderr
    assert bundle_files(tmp_path) == []


def test_an_infinite_value_in_the_test_split_is_named_by_its_row(tmp_path):
    rows = feature_rows()
    write_features(tmp_path / "train.csv", rows=rows[:120])
    write_features(tmp_path / "test.csv", "1e400", every=1000, rows=rows[120:])  # row 1 only
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  tmp_path / "train.csv", "--test_path", tmp_path / "test.csv",
                  "--label_column", "kind", "--epochs", "2", "--output_model",
                  tmp_path / "model.onnx", *FAST)
    assert_clean_failure(run, 3, "1 row holds an infinite value", "'weight': 1 in the test split",
                         "test.csv row 1")
    assert TOLERANCE_ADVICE not in run.stderr


def test_export_refuses_held_out_samples_with_infinite_values(tmp_path):
    """train.py reads only train and val; export.py then meets the inf cell in the test split:
    the non-finite outputs are put down to the data (exit 3), not to the weights."""
    rows = feature_rows()
    write_features(tmp_path / "train.csv", rows=rows[:120])
    write_features(tmp_path / "test.csv", "inf", every=1000, rows=rows[120:])
    model = tmp_path / "model.onnx"
    trained = run_cli("train.py", "--model_type", "tabular_classifier", "--dataset_path",
                      tmp_path / "train.csv", "--test_path", tmp_path / "test.csv",
                      "--label_column", "kind", "--epochs", "2", "--output_model", model, *FAST)
    assert trained.returncode == 0, trained.stderr[-3000:]
    run = run_cli("export.py", "--output_model", model, "--dataset_path", tmp_path / "train.csv",
                  "--test_path", tmp_path / "test.csv", *FAST)
    assert_clean_failure(run, 3, "1 held-out sample holds an infinite value",
                         "outputs on them are not finite (nan)", "remove those rows")
    assert TOLERANCE_ADVICE not in run.stderr
    assert not model.exists()


# ----------------------------------------------------------------------------- export


def test_export_of_nan_weights_blames_the_weights_not_the_tolerance(tmp_path):
    import torch

    model = tmp_path / "model.onnx"
    trained = run_cli("train.py", "--model_type", "tabular_classifier", "--dataset_path",
                      "builtin:iris", "--epochs", "1", "--output_model", model, *FAST)
    assert trained.returncode == 0, trained.stderr[-3000:]
    weights, manifest_path = model.with_suffix(".pt"), model.with_suffix(".json")
    state = torch.load(weights, weights_only=True)
    state["classifier.weight"][0, 0] = float("nan")
    torch.save(state, weights)
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["sha256"]["weights"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest, indent=2))
    run = run_cli("export.py", "--output_model", model, *FAST)
    assert_clean_failure(run, 4, "the model produces non-finite outputs (nan) in PyTorch",
                         "its weights are not finite (in classifier.weight): training likely "
                         "diverged", "the bundle was not written",
                         "a tolerance cannot fix this: retrain with a lower --learning_rate")
    assert TOLERANCE_ADVICE not in run.stderr
    assert not model.exists()


@pytest.fixture(scope="module")
def linear_graph():
    """A 4 → 3 linear classifier and its exported, slimmed graph."""
    import torch

    from ttc.convert.tracing import export_graph, slim_graph
    from ttc.serving.bundle import InputSpec

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    samples = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    spec = InputSpec.from_dict({"name": "features", "dtype": "float32", "shape": ["batch", 4]})
    graph = slim_graph(export_graph(net, samples[:2], 18, spec, ["logits", "probabilities"]))
    return net, graph, samples


def _compare(net, graph, samples):
    from ttc.convert.checking import compare_with_torch
    from ttc.serving.bundle import InputSpec

    spec = InputSpec.from_dict({"name": "features", "dtype": "float32", "shape": ["batch", 4]})
    return compare_with_torch(graph, net, samples, spec, 1e-4, 64, 1)


def test_numeric_check_sorts_non_finite_and_huge_outputs_by_cause(linear_graph):
    import copy

    import torch

    from utils import DataError, ExportError

    net, graph, samples = linear_graph
    assert _compare(net, graph, samples).max_abs_diff <= 1e-4  # the healthy model passes

    nan_net = copy.deepcopy(net)
    with torch.no_grad():
        nan_net[0].weight[0, 0] = float("nan")
    with pytest.raises(ExportError) as caught:
        _compare(nan_net, graph, samples)
    line = caught.value.one_line()
    assert "non-finite outputs (nan) in PyTorch on 32 of 32 held-out samples" in line, line
    assert "lower --learning_rate" in line and TOLERANCE_ADVICE not in line

    # huge but finite weights (a run that diverged without overflowing): no tolerance advice
    huge_net = copy.deepcopy(net)
    with torch.no_grad():
        huge_net[0].weight.mul_(1e6)
    with pytest.raises(ExportError) as caught:
        _compare(huge_net, graph, samples)
    line = caught.value.one_line()
    assert "numeric check failed" in line and "the model's logits reach" in line, line
    assert "weights likely diverged" in line and TOLERANCE_ADVICE not in line

    # an infinite input gives non-finite outputs on its row only: the data's fault
    dirty = samples.copy()
    dirty[5, 2] = np.inf
    with pytest.raises(DataError) as caught:
        _compare(net, graph, dirty)
    assert "1 held-out sample holds an infinite value" in caught.value.one_line()


def test_extra_graph_check_does_not_advise_a_tolerance_for_nan():
    from ttc.convert.checking import _require_close
    from utils import ExportError

    config = SimpleNamespace(validate_atol=1e-4)
    with pytest.raises(ExportError) as caught:
        _require_close(float("nan"), "ensemble graph", config)
    line = caught.value.one_line()
    assert "gives non-finite outputs (nan difference" in line and TOLERANCE_ADVICE not in line
    assert caught.value.exit_code == 4
    with pytest.raises(ExportError) as caught:  # a finite excess is still a tolerance matter
        _require_close(0.5, "ensemble graph", config)
    assert TOLERANCE_ADVICE in caught.value.one_line()
