"""Test-time training on streams: the guard (ttt_guard.py) against correlated batches and
collapse, the stream orders and the report's `ttt.stream` (ttt_stream.py), and Tent's
`--ttt_predict before` (tent.py's outputs)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from conftest import assert_clean_failure, run_cli


@pytest.fixture(scope="module")
def digits_stream(digits_bundle):
    """The session's digits bundle, its adaptation graph and 320 digits with their labels."""
    from sklearn.datasets import load_digits

    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.serving.runtime import RuntimeOptions, create_session
    from ttc.testtime.ttt import AdaptationGraph

    paths = BundlePaths.from_model_path(digits_bundle["model"])
    graph = AdaptationGraph(onnx.load(str(paths.bn)),
                            lambda m: create_session(m, RuntimeOptions()))
    digits = load_digits()
    x = (digits.images[:320] / 16.0).astype(np.float32)[:, None]
    return paths, read_manifest(paths), graph, x, digits.target[:320]


def source_of(graph, x: np.ndarray, batch_size: int = 32) -> np.ndarray:
    from ttc.testtime.ttt import SOURCE_PRIOR

    return np.concatenate([graph.run(x[i:i + batch_size], SOURCE_PRIOR, {})[0]
                           for i in range(0, len(x), batch_size)])


def test_the_guard_leaves_an_exchangeable_stream_alone_and_catches_a_sorted_one():
    from ttc.testtime.ttt_guard import StreamGuard

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 64 * 60)
    confident = np.eye(10, dtype=np.float32)[labels] * 0.9 + 0.01
    guard = StreamGuard("reset", seed=1)
    fired = [guard.correlated(confident[i:i + 64]) for i in range(0, len(labels), 64)]
    assert fired.count(None) == len(fired)  # 60 shuffled batches: no false alarm
    ordered = confident[np.argsort(labels, kind="stable")]
    guard = StreamGuard("reset", seed=1)
    fired = [guard.correlated(ordered[i:i + 64]) for i in range(0, len(labels), 64)]
    assert sum(f is not None for f in fired) >= 50 and "class mix" in next(f for f in fired if f)
    # a batch whose halves hold different classes is caught from the stream's first batch on
    first = StreamGuard("reset").correlated(np.eye(10, dtype=np.float32)[[0] * 32 + [1] * 32])
    assert first is not None and "two halves" in first


def test_stream_orders():
    from ttc.inputs.shifts import parse_stream_order
    from ttc.testtime.ttt_stream import stream_order
    from utils import ConfigError

    y = np.repeat(np.arange(10), 30)[np.random.default_rng(0).permutation(300)]
    assert (np.diff(y[stream_order(y, "label_sorted", 32, 0)]) >= 0).all()
    shuffled = stream_order(y, "shuffled", 32, 0)
    assert sorted(shuffled) == list(range(300)) and not (np.diff(y[shuffled]) >= 0).all()

    def classes_per_batch(order: np.ndarray) -> float:
        return np.mean([len(set(y[order[i:i + 32]])) for i in range(0, 300, 32)])

    concentrated = stream_order(y, "dirichlet:0.05", 32, 0)
    assert sorted(concentrated) == list(range(300))
    assert classes_per_batch(concentrated) < classes_per_batch(shuffled) - 3
    assert parse_stream_order("dirichlet:0.5") == ("dirichlet", 0.5)
    for bad in ("sorted", "dirichlet:0", "dirichlet:x", "shuffled:2"):
        with pytest.raises(ConfigError):
            parse_stream_order(bad)


def test_a_label_sorted_stream_is_served_by_the_source_model_under_the_guard(digits_stream):
    from ttc.testtime.ttt import adapt_and_predict
    from ttc.testtime.ttt_guard import StreamGuard

    _, _, graph, x, y = digits_stream
    order = np.argsort(y, kind="stable")  # 32 of each digit: batches of 48 hold two classes
    sorted_x, sorted_y = x[order], y[order]
    source = source_of(graph, sorted_x)
    unguarded = adapt_and_predict(graph, "bn", sorted_x, 48, "episodic", 0, 0,
                                  guard=StreamGuard("none"))
    assert (unguarded.probabilities.argmax(1) == sorted_y).mean() < \
        (source.argmax(1) == sorted_y).mean() - 0.05  # what the guard is for
    for mode in ("reset", "filter"):
        guard = StreamGuard(mode)
        guarded = adapt_and_predict(graph, "bn", sorted_x, 48, "episodic", 0, 0, guard=guard)
        np.testing.assert_allclose(guarded.probabilities, source, atol=1e-5)
        acted = guarded.resets if mode == "reset" else guarded.skipped
        assert acted == 7 and guard.counted()["resets" if mode == "reset" else "skipped"] == 7
    # a shuffled stream: the guard never fires and the outputs are the unguarded ones
    shuffled = x[np.random.default_rng(0).permutation(len(x))]
    plain = adapt_and_predict(graph, "bn", shuffled, 32, "episodic", 0, 0,
                              guard=StreamGuard("none"))
    kept = adapt_and_predict(graph, "bn", shuffled, 32, "episodic", 0, 0,
                             guard=StreamGuard("filter"))
    assert kept.resets == kept.skipped == 0
    np.testing.assert_array_equal(kept.probabilities, plain.probabilities)


class CollapsingGraph:
    """An adaptation graph whose adapted predictions pile onto class 0 from the third batch on,
    while the source model's stay spread: a synthetic collapse."""

    pad_id, not_applicable = 0, {}

    def __init__(self) -> None:
        self.adapted_batches = 0

    def applicable(self, methods: list[str]) -> list[str]:
        return methods

    def run(self, x: np.ndarray, prior: float, params: dict) -> tuple[np.ndarray, dict]:
        from ttc.testtime.ttt import SOURCE_PRIOR

        spread = np.eye(4, dtype=np.float32)[np.arange(len(x)) % 4] * 0.9 + 0.025
        if prior >= SOURCE_PRIOR:
            return spread, {}
        self.adapted_batches += 1
        collapsed = np.tile(np.float32([0.97, 0.01, 0.01, 0.01]), (len(x), 1))
        return (collapsed if self.adapted_batches > 2 else spread), {"m": np.zeros(1)}


@pytest.mark.parametrize("mode", ["reset", "filter"])
def test_the_guard_resets_online_adaptation_on_a_synthetic_collapse(mode):
    from ttc.testtime.ttt import adapt_and_predict
    from ttc.testtime.ttt_guard import StreamGuard

    x = np.zeros((32 * 6, 3), np.float32)
    unguarded = adapt_and_predict(CollapsingGraph(), "bn", x, 32, "online", 0, 0,
                                  guard=StreamGuard("none"))
    assert unguarded.resets == 0
    guarded = adapt_and_predict(CollapsingGraph(), "bn", x, 32, "online", 0, 0,
                                guard=StreamGuard(mode))
    assert guarded.resets == 4 and guarded.skipped == 0  # batches 3 to 6 collapsed


def test_predict_before_serves_the_forward_pass_of_a_hand_run_tent_step(digits_stream):
    import torch

    from ttc.inputs.shifts import corrupt
    from ttc.nets.models import load_weights
    from ttc.testtime.ttt import Tent, adapt_and_predict

    paths, manifest, graph, x, _ = digits_stream
    batch = corrupt(x[:32], "contrast", 3, {"kind": "image"}, 0)
    tent = Tent(manifest, paths.weights, graph.layers, learning_rate=0.01, steps=1)
    before = adapt_and_predict(graph, "tent", batch, 32, "episodic", 0, 0, tent,
                               predict_before=True).probabilities
    after = adapt_and_predict(graph, "tent", batch, 32, "episodic", 0, 0, tent).probabilities
    # by hand, as tent.py: BatchNorm on batch statistics, one forward, one Adam step
    net = load_weights(manifest, paths.weights).eval()
    net.requires_grad_(False)
    norms = [m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.train()
        norm.track_running_stats, norm.running_mean, norm.running_var = False, None, None
        norm.requires_grad_(True)
    params = [p for norm in norms for p in (norm.weight, norm.bias)]
    optimizer = torch.optim.Adam(params, lr=0.01)
    logits = net(torch.from_numpy(batch)) / manifest.temperature
    entropy = -(logits.softmax(1) * logits.log_softmax(1)).sum(1).mean()
    entropy.backward()
    optimizer.step()
    np.testing.assert_allclose(before, logits.softmax(1).detach().numpy(), atol=1e-5)
    stepped = dict(zip([n for layer in graph.layers for n in (layer.scale, layer.bias)],
                       [p.detach().numpy() for p in params]))
    np.testing.assert_allclose(after, graph.run(batch, 0.0, stepped)[0], atol=1e-5)
    assert np.abs(after - before).max() > 1e-4  # the step changed the predictions


def test_inference_reports_the_stream_per_pass_with_and_without_the_guard(digits_bundle):
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--ttt", "true",
                  "--eval_shift", "contrast", "--eval_stream", "label_sorted",
                  "--stream_passes", "2", "--ttt_mode", "online", "--report_json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    ttt = json.loads(run.stdout)["ttt"]
    assert ttt["guard"] == "filter" and ttt["predict"] == "after"
    stream = ttt["stream"]
    assert (stream["order"], stream["passes"], stream["mode"]) == ("label_sorted", 2, "online")
    runs = {(r["shift"], r["guard"]): r for r in stream["runs"]}
    assert set(runs) == {("clean", "none"), ("clean", "filter"), ("contrast", "none"),
                         ("contrast", "filter")}
    for run_ in runs.values():
        assert run_["method"] == "bn" and len(run_["accuracy_per_pass"]) == 2
        assert len(run_["source_accuracy_per_pass"]) == 2
    clean, guarded = runs[("clean", "none")], runs[("clean", "filter")]
    source = clean["source_accuracy_per_pass"][0]
    assert max(clean["accuracy_per_pass"]) < source - 0.05
    assert min(guarded["accuracy_per_pass"]) >= source - 0.01 and guarded["skipped"] > 0


@pytest.mark.parametrize("args,code,phrase", [
    (["--ttt", "true", "--eval_stream", "sorted"], 2, "--eval_stream 'sorted'"),
    (["--eval_stream", "shuffled"], 2, "--ttt is off"),
    (["--ttt", "true", "--eval_stream", "shuffled", "--stream_passes", "0"], 2,
     "--stream_passes"),
    (["--ttt", "true", "--ttt_guard", "always"], 2, "--ttt_guard"),
    (["--ttt", "true", "--ttt_predict", "during"], 2, "--ttt_predict"),
])
def test_bad_stream_flags_exit_2(tmp_path, args, code, phrase):
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--output_model",
                  tmp_path / "m.onnx", *args)
    assert_clean_failure(run, code, phrase)
