"""The Python API under serve.py (`Predictor.load(bundle).predict(rows)`) and the bundle as a
DSPy tool: the same predictions as `inference.py --input` on the same rows, the same one-line
reasons for bad rows, and a DSPy ReAct program (driven by DummyLM, offline) that calls the tool
and gets the model's answer."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from conftest import feature_rows, run_cli, topic_texts


def batch_predictions(model, rows: list[dict], tmp_path, *flags: str) -> list[dict]:
    """inference.py --input rows.jsonl on the same rows: one dict per row, in order."""
    source, output = tmp_path / "rows.jsonl", tmp_path / "preds.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = run_cli("inference.py", "--model", model, "--input", source, "--output", output,
                  *flags)
    assert run.returncode == 0, run.stderr[-2000:]
    return [json.loads(line) for line in output.read_text().splitlines()]


def assert_same(api: list[dict], batch: list[dict], top_k: int) -> None:
    assert len(api) == len(batch)
    for mine, theirs in zip(api, batch):
        assert mine["label"] == theirs["label"]
        assert mine["confidence"] == pytest.approx(theirs["confidence"], abs=1e-6)
        assert len(mine["top"]) == top_k
        assert list(mine["top"][0]) == [mine["label"], mine["confidence"]]  # the table: once
        for k, (label, probability) in enumerate(mine["top"][1:], 2):
            assert label == theirs[f"top{k}_label"]
            assert probability == pytest.approx(theirs[f"top{k}_probability"], abs=1e-6)


def text_rows() -> list[dict]:
    texts = [t for t, _ in topic_texts(per_class=4, seed=3)]
    return [{"text": t} for t in texts] + [{"text": "x " * 40}, {"text": "goal"}]


def tabular_rows() -> list[dict]:
    return [{k: v for k, v in row.items() if k != "kind"} for row in feature_rows(6, seed=5)]


@pytest.mark.parametrize("name, rows, top_k", [("text", text_rows, 2),
                                               ("tabular", tabular_rows, 1)])
def test_the_api_predicts_what_batch_inference_predicts(request, tmp_path, name, rows, top_k):
    from ttc.online.predictor import Predictor

    bundle = request.getfixturevalue(f"{name}_bundle")
    given = rows()
    predictor = Predictor.load(bundle["model"], top_k=top_k)
    assert_same(predictor.predict(given),
                batch_predictions(bundle["model"], given, tmp_path, "--top_k", str(top_k)),
                top_k)


@pytest.mark.parametrize("flags, method", [(["--tta", "true"], {"tta": True}),
                                           (["--iterative", "mc_dropout", "--iterations", "8"],
                                            {"iterative": "mc_dropout", "iterations": 8})])
def test_test_time_compute_predicts_as_batch_inference(text_bundle, tmp_path, flags, method):
    """--tta and MC-dropout from the same graphs as `inference.py --input` (MC-dropout's extra
    values, entropy and std, too)."""
    from ttc.online.predictor import Predictor

    rows = text_rows()
    api = Predictor.load(text_bundle["model"], top_k=2, **method).predict(rows)
    batch = batch_predictions(text_bundle["model"], rows, tmp_path, "--top_k", "2", *flags)
    assert_same(api, batch, 2)
    extra = [key for key in batch[0] if key in ("entropy", "std")]
    assert bool(extra) == ("iterative" in method)
    for mine, theirs in zip(api, batch):
        assert all(mine[key] == pytest.approx(theirs[key], abs=1e-6) for key in extra)


def test_a_bad_row_fails_with_the_reason_the_batch_path_gives(tabular_bundle, tmp_path):
    from ttc.online.predictor import Predictor
    from ttc.serving.records import RowError

    rows = tabular_rows()[:3]
    rows[1] = dict(rows[1], height="tall")
    errors = tmp_path / "errors.csv"
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = run_cli("inference.py", "--model", tabular_bundle["model"], "--input", source,
                  "--output", tmp_path / "preds.csv", "--errors", errors, "--allow_errors",
                  "true")
    assert run.returncode == 0, run.stderr[-2000:]
    [(ident, reason)] = [(r["id"], r["reason"]) for r in csv.DictReader(errors.open())]
    with pytest.raises(RowError) as raised:
        Predictor.load(tabular_bundle["model"]).predict(rows)
    assert str(raised.value).startswith(f"row {ident}: {reason}")


def test_a_request_the_network_overflows_on_fails_alone_under_ttt(tabular_bundle, monkeypatch):
    """Test-time training adapts BatchNorm to the joined batch, whose statistics one
    overflowing row turns NaN for every row: the request holding it gets a RowError (never NaN
    in an answer), and the requests batched with it are run again without it and answered.
    (The encoder's range check, which refuses such a number first, is lifted here.)"""
    import ttc.inputs.preprocess as preprocess
    from ttc.online.predictor import Predictor
    from ttc.serving.records import RowError

    monkeypatch.setattr(preprocess, "MAX_STANDARDISED", float("inf"))
    predictor = Predictor.load(tabular_bundle["model"], ttt="bn")
    rows = tabular_rows()
    good = [dict(row, height="1.0", weight="-2.0") for row in rows[:6]]
    overflowing = dict(rows[6], height="3.3e38", weight="-3.3e38")
    outcomes = predictor.predict_parts([(good[:3], 1), ([good[3], overflowing], 5),
                                        (good[4:], 1)])
    assert isinstance(outcomes[1], RowError), outcomes[1]
    assert "the model's output for this row is not a finite number" in str(outcomes[1])
    for outcome in (outcomes[0], outcomes[2]):
        assert not isinstance(outcome, Exception), outcome
        assert np.isfinite(outcome[0]).all() and len(outcome[0]) in (2, 3)
    with pytest.raises(RowError, match="^row [12]: the model's output"):
        predictor.predict([good[0], overflowing])


def test_any_exception_encoding_a_request_stays_with_it(tabular_bundle):
    """Text no UTF-8 encoder takes (a lone surrogate, from the Python API or a JSON escape)
    fails in a library, not in the tool's checks: the request holding it gets a RowError
    naming its row, and the requests encoded in the same pass are answered."""
    from ttc.online.predictor import Predictor
    from ttc.serving.records import RowError

    predictor = Predictor.load(tabular_bundle["model"])
    rows = tabular_rows()[:6]
    bad = [rows[2], dict(rows[3], color="red\udc9f")]
    outcomes = predictor.predict_parts([(rows[:2], 1), (bad, 1), (rows[4:], 1)])
    assert isinstance(outcomes[1], RowError)
    assert str(outcomes[1]).startswith("row 2: a key or value holds text that is not valid "
                                       "Unicode"), outcomes[1]
    assert [len(o[0]) for o in (outcomes[0], outcomes[2])] == [2, 2]
    assert predictor.predict(rows[:2]) == predictor.predictions(*outcomes[0])


def test_a_missing_column_names_the_columns_the_model_takes(text_bundle):
    from ttc.online.predictor import Predictor
    from utils import DataError

    with pytest.raises(DataError, match=r"lacks the text columns \['text'\].*\['message'\]"):
        Predictor.load(text_bundle["model"]).predict([{"message": "hi"}])


def test_the_dspy_tool_describes_the_model_and_predicts_as_the_api(tabular_bundle):
    from ttc.online.predictor import Predictor

    predictor = Predictor.load(tabular_bundle["model"], top_k=2)
    tool = predictor.as_dspy_tool()
    assert tool.name == "tabular_classifier"
    assert all(repr(label) in tool.desc for label in predictor.manifest.labels)
    assert tool.args == {"height": {"type": "number", "description": "the feature 'height'"},
                         "weight": {"type": "number", "description": "the feature 'weight'"},
                         "color": {"type": "string", "description": "the category 'color'"}}
    row = next({**r, "height": float(r["height"]), "weight": float(r["weight"])}
               for r in tabular_rows() if r["height"])
    assert tool(**row) == predictor.predict([row])[0]
    with pytest.raises(ValueError, match="height"):
        tool(height="not a number", weight=1.0, color="red")  # the schema refuses it first


def test_a_react_program_calls_the_model_as_a_tool(text_bundle):
    """A DSPy agent (its LM scripted by DummyLM: call the tool, then finish) gets the model's
    prediction as the tool's observation, ONNX Runtime only."""
    import dspy
    from dspy.utils import DummyLM

    from ttc.online.predictor import Predictor

    predictor = Predictor.load(text_bundle["model"])
    tool = predictor.as_dspy_tool()
    message = "the goal and the team and the score of the match"
    expected = predictor.predict([{"text": message}])[0]
    assert expected["label"] == "sports"
    lm = DummyLM([{"next_thought": "Ask the classifier.", "next_tool_name": tool.name,
                   "next_tool_args": {"text": message}},
                  {"next_thought": "It answered.", "next_tool_name": "finish",
                   "next_tool_args": {}},
                  {"reasoning": "The classifier's label.", "topic": expected["label"]}])
    with dspy.context(lm=lm):
        result = dspy.ReAct("message -> topic", tools=[tool])(message=message)
    assert result.trajectory["tool_name_0"] == "text_classifier"
    assert result.trajectory["observation_0"] == expected
    assert result.topic == "sports"


TRICKY_ROWS = [
    [{"a": 1, "b": 2.0, "t": "x"}, {"a": None, "b": 3.5, "t": ""}, {"t": "  "}],
    [{"n": 2 ** 53 + 1, "f": 1e-300, "g": 1.0}, {"n": -3, "f": float("1e308"), "g": 2}],
    [{"b": True, "i": 1}, {"b": False, "i": 0}, {"b": None, "i": None}],
    [{"created_at": "2020-01-01", "timestamp": 1600000000}],
    [{"list": [1, 2], "obj": {"k": 1}, "s": "é ✓"}, {"s": "x"}],
    [{"x": 1}, {"y": "2"}, {}],
]


@pytest.mark.parametrize("rows", TRICKY_ROWS)
def test_request_rows_read_as_the_lines_of_a_jsonl_file(rows, tmp_path):
    """tables.json_records (a request's parsed rows) builds the frame that reading the same rows
    from a JSONL file builds: the same cells, rows, index and nested-column marks."""
    from pathlib import Path

    from ttc.inputs.tables import iter_table, json_records

    source = Path(tmp_path) / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    [from_file] = list(iter_table(source, "jsonl"))
    from_request = json_records(rows)
    assert from_request.attrs == from_file.attrs
    assert list(from_request.columns) == list(from_file.columns)
    assert list(from_request.index) == list(from_file.index)
    assert from_request.astype(str).values.tolist() == from_file.astype(str).values.tolist()


def test_the_api_checks_its_flags_as_serve_py_does(tabular_bundle):
    """Predictor.load has no Config: its flags are serve.py's (ServeOptions), checked by the same
    checks with the same lines, and a name that is no flag of serve.py is refused by name."""
    from ttc.online.predictor import Predictor
    from utils import ConfigError

    cli = run_cli("serve.py", "--model", tabular_bundle["model"], "--max_batch_size", "0")
    assert cli.returncode == 2
    with pytest.raises(ConfigError) as raised:
        Predictor.load(tabular_bundle["model"], max_batch_size=0)
    assert raised.value.one_line() in cli.stderr
    with pytest.raises(ConfigError, match="'max_batch' is not one"):
        Predictor.load(tabular_bundle["model"], max_batch=8)
    assert Predictor.load(tabular_bundle["model"], max_batch_size=4).options.batch_size == 4
