"""Test-time augmentation: transforms, merge rules, adaptive triggering, and the CLIs."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import assert_clean_failure, run_cli

IMAGE = {"kind": "image", "image_size": [6, 6], "channels": 3}
TEXT = {"kind": "text"}
TABULAR = {"kind": "tabular", "feature_names": ["a", "b", "c=x"], "std": [2.0, 0.5, 0.4],
           "columns": [{"name": "a", "type": "numeric"}, {"name": "b", "type": "numeric"},
                       {"name": "c", "type": "categorical", "categories": ["x"]}]}
IMAGE_SPECS = {"hflip": 1, "flip": 1, "vflip": 1, "rot90": 1, "rot180": 1, "rot270": 1,
               "rotate:15": 2, "shift:1": 4, "crop:0.8": 1, "scale:1.2": 1, "brightness:0.1": 2,
               "contrast:1.5": 1}


def build(spec, pre, seed=0):
    from ttc.testtime.tta import build_transforms

    return build_transforms(spec, pre, seed)


def tiny_classifier(kind, features, classes=3, seed=0):
    """A small ONNX classifier with the bundle's outputs (logits, probabilities), opset 18:
    image/tabular → Flatten → MatMul; text → Gather of token embeddings → ReduceSum."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((features, classes)).astype(np.float32)
    if kind == "text":
        weight[0] = 0  # padding adds nothing
        nodes = [helper.make_node("Gather", ["weight", "input"], ["embedded"]),
                 helper.make_node("ReduceSum", ["embedded", "axis"], ["logits"], keepdims=0)]
        graph_input = helper.make_tensor_value_info("input", TensorProto.INT64, ["batch", "len"])
        extra = [numpy_helper.from_array(np.array([1], np.int64), "axis")]
    else:
        nodes = [helper.make_node("Flatten", ["input"], ["flat"]),
                 helper.make_node("MatMul", ["flat", "weight"], ["logits"])]
        shape = ["batch", *IMAGE_SHAPE] if kind == "image" else ["batch", features]
        graph_input = helper.make_tensor_value_info("input", TensorProto.FLOAT, shape)
        extra = []
    nodes.append(helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1))
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", classes])
               for n in ("logits", "probabilities")]
    graph = helper.make_graph(nodes, "tiny", [graph_input], outputs,
                              [numpy_helper.from_array(weight, "weight"), *extra])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


IMAGE_SHAPE = (3, 6, 6)


def runners(kind, spec, pre, features, merge_mode="mean", batch_size=4):
    """The same TTA through the ONNX graph and through numpy views, on a tiny model."""
    import onnxruntime as ort
    from ttc.testtime.tta import TTARunner, tta_model

    model = tiny_classifier(kind, features)
    transforms = build(spec, pre, seed=7)
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    predict = lambda b: plain.run(["probabilities"], {"input": b})[0]  # noqa: E731
    graph_model = tta_model(model, transforms, merge_mode, 3)
    assert graph_model is not None
    merged = ort.InferenceSession(graph_model.SerializeToString(),
                                  providers=["CPUExecutionProvider"])
    in_graph = TTARunner(predict, transforms, merge_mode, batch_size,
                         lambda b: merged.run(["probabilities"], {"input": b})[0])
    return in_graph, TTARunner(predict, transforms, merge_mode, batch_size)


@pytest.mark.parametrize("spec,views", IMAGE_SPECS.items())
def test_image_transforms_keep_shape_dtype_and_range(spec, views):
    from ttc.testtime.tta import expand

    x = np.random.default_rng(0).random((5, 3, 6, 6)).astype(np.float32)
    stacked, owners = expand(x, build(spec, IMAGE))
    assert stacked.shape == (5 * (1 + views), 3, 6, 6) and stacked.dtype == np.float32
    assert stacked.min() >= 0 and stacked.max() <= 1
    assert owners is None  # every view covers the whole batch, in order: the fast merge path
    np.testing.assert_array_equal(stacked[:5], x)  # the plain view comes first


def test_transforms_that_compose_to_identity_do():
    x = np.random.default_rng(1).random((2, 3, 6, 6)).astype(np.float32)
    (hflip,), (rot90,), (shift,) = build("hflip", IMAGE), build("rot90", IMAGE), build("shift:1", IMAGE)
    np.testing.assert_array_equal(hflip.views(hflip.views(x)[0])[0], x)
    y = x
    for _ in range(4):
        y = rot90.views(y)[0]
    np.testing.assert_array_equal(y, x)
    right, left = shift.views(x)[2], shift.views(x)[3]
    np.testing.assert_array_equal(right[..., 1:], x[..., :-1])  # content moved one pixel right
    np.testing.assert_array_equal(left[..., :-1], x[..., 1:])


def test_rotate_small_angle_is_close_and_rot90_needs_square_images():
    from utils import ConfigError

    x = np.random.default_rng(2).random((1, 1, 6, 6)).astype(np.float32)
    (rotate,) = build("rotate:1", IMAGE)
    plus, minus = rotate.views(x)
    assert np.abs(plus - x).mean() < 0.05 and not np.array_equal(plus, minus)
    with pytest.raises(ConfigError):
        build("rot90", {**IMAGE, "image_size": [6, 8]})


def test_token_dropout_keeps_order_and_a_token_and_windows_cover_long_texts():
    from ttc.testtime.tta import expand

    ids = np.array([[5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 0, 0, 0, 0, 0, 0]], dtype=np.int64)
    stacked, owners = expand(ids, build("token_dropout:0.5", TEXT, seed=3))
    assert stacked.dtype == np.int64 and stacked.shape == (4, 8) and owners is None
    for plain, view in zip(ids, stacked[2:]):
        kept = view[view != 0]
        assert 1 <= len(kept) and list(kept) == [t for t in plain if t in set(kept)]
        assert ((view == 0) | (view == plain)).all()  # dropped tokens become padding, in place
    all_dropped = expand(ids, build("token_dropout:0.99", TEXT, seed=3))[0][2:]
    assert (all_dropped[:, 0] == ids[:, 0]).all()  # a text never loses its last token
    again = expand(ids[::-1].copy(), build("token_dropout:0.5", TEXT, seed=3))[0][2:]
    np.testing.assert_array_equal(again[::-1], stacked[2:])  # batch order does not matter
    stacked, owners = expand(ids, build("window:4", TEXT))
    # the long text gets windows [0:4], [2:6], [4:8]; the short one only its plain view
    assert list(owners) == [0, 1, 0, 0, 0]
    np.testing.assert_array_equal(stacked[2:, :4], [[5, 6, 7, 8], [7, 8, 9, 10], [9, 10, 11, 12]])


def test_tabular_jitter_moves_numeric_features_only_and_keeps_nan():
    x = np.array([[1.0, np.nan, 1.0], [2.0, 3.0, 0.0]], dtype=np.float32)
    (jitter,) = build("jitter:0.5", TABULAR)
    (view,) = jitter.views(x)
    assert view.dtype == np.float32 and view.shape == x.shape
    assert np.isnan(view[0, 1]) and not np.allclose(view[:, 0], x[:, 0])
    np.testing.assert_array_equal(view[:, 2], x[:, 2])


@pytest.mark.parametrize("spec", [s for s in IMAGE_SPECS if s != "flip"])
def test_image_views_in_the_onnx_graph_match_numpy(spec):
    x = np.random.default_rng(5).random((9, *IMAGE_SHAPE)).astype(np.float32)
    in_graph, numpy_views = runners("image", f"{spec},hflip", IMAGE, int(np.prod(IMAGE_SHAPE)))
    assert in_graph.backend == "onnx_graph" and numpy_views.backend == "numpy"
    np.testing.assert_allclose(in_graph(x), numpy_views(x), atol=2e-5)


@pytest.mark.parametrize("merge_mode", ["mean", "gmean", "max", "vote", "tsharpen"])
def test_text_and_tabular_views_and_every_merge_in_the_graph_match_numpy(merge_mode):
    ids = np.random.default_rng(6).integers(1, 20, (7, 9))
    ids[3:, 5:] = 0  # shorter texts, padded
    text = {**TEXT, "max_length": 9}
    graph, reference = runners("text", "token_dropout:0.3,token_dropout:0.6", text, 20, merge_mode)
    np.testing.assert_allclose(graph(ids), reference(ids), atol=1e-5)
    rows = np.random.default_rng(6).standard_normal((7, 3)).astype(np.float32)
    rows[2, 1] = np.nan
    graph, reference = runners("tabular", "jitter:0.3,jitter:1", TABULAR, 3, merge_mode)
    np.testing.assert_allclose(graph(rows), reference(rows), atol=1e-5)


PLAN_CASES = [  # (kind, transforms, preprocessing, features): every kind of view
    ("image", "shift:1,rotate:10,hflip,brightness:0.1", IMAGE, int(np.prod(IMAGE_SHAPE))),
    ("text", "token_dropout:0.3,token_dropout:0.6", {**TEXT, "max_length": 9}, 20),
    ("tabular", "jitter:0.3,jitter:1", TABULAR, 3),
]


def plan_inputs(kind):
    rng = np.random.default_rng(9)
    if kind == "image":
        return rng.random((11, *IMAGE_SHAPE)).astype(np.float32)
    if kind == "text":
        ids = rng.integers(1, 20, (11, 9))
        ids[4:, 5:] = 0  # shorter texts, padded
        return ids
    rows = rng.standard_normal((11, 3)).astype(np.float32)
    rows[2, 1] = np.nan
    return rows


@pytest.mark.parametrize("merge_mode", ["mean", "gmean", "max", "vote", "tsharpen"])
@pytest.mark.parametrize("kind,spec,pre,features", PLAN_CASES)
def test_graph_and_loop_plans_give_identical_outputs(kind, spec, pre, features, merge_mode):
    """The loop plan (one session.run per view, numpy merge) against the graph plan with the
    views in the ONNX graph and with numpy-stacked views, at several batch sizes."""
    from dataclasses import replace

    x = plan_inputs(kind)
    graph_runner, numpy_runner = runners(kind, spec, pre, features, merge_mode)
    for batch_size in (1, 4, 16):
        in_graph = replace(graph_runner, batch_size=batch_size)
        stacked = replace(numpy_runner, batch_size=batch_size)
        loop = in_graph.with_plan("loop")
        assert (in_graph.plan, stacked.plan, loop.plan) == ("graph", "graph", "loop")
        expected = in_graph(x)
        for other in (loop, stacked, stacked.with_plan("loop")):
            got = other(x)
            np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)
            np.testing.assert_array_equal(got.argmax(1), expected.argmax(1))


def test_loop_plan_runs_one_view_at_a_time_and_handles_windows():
    from ttc.testtime.tta import TTARunner

    ids = np.array([[5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 0, 0, 0, 0, 0, 0]], dtype=np.int64)
    rows = []

    def predict(batch):
        rows.append(len(batch))
        return np.stack([batch.sum(1) % 3 == k for k in range(3)], 1).astype(np.float32) + 0.1

    transforms = build("token_dropout:0.5,window:4", TEXT, seed=3)
    loop = TTARunner(predict, transforms, "mean", 2, plan="loop")
    out = loop(ids)
    assert rows == [2, 2, 3]  # plain, the dropout view, then the long text's 3 windows in one run
    rows.clear()
    stacked = TTARunner(predict, transforms, "mean", 2)(ids)
    # the graph plan's numpy twin: all of a chunk's views in one run, a chunk being
    # batch_size / views texts (here 1): 5 views of the long text, then 2 of the short one
    assert rows == [5, 2]
    np.testing.assert_allclose(out, stacked, atol=1e-6)


def test_choose_plan_times_both_and_keeps_the_faster():
    from ttc.testtime.tta import PLANS, choose_plan

    in_graph, _ = runners("image", "hflip,vflip", IMAGE, int(np.prod(IMAGE_SHAPE)))
    probe = np.random.default_rng(3).random((4, *IMAGE_SHAPE)).astype(np.float32)
    chosen = choose_plan(in_graph, probe)
    timings = chosen.plan_timings
    assert timings is not None and timings.batch_size == 4
    assert timings.graph_ms > 0 and timings.loop_ms > 0
    assert chosen.plan == timings.faster and chosen.plan in PLANS
    assert timings.report() == {"graph_ms": round(timings.graph_ms, 4), "batch_size": 4,
                                "loop_ms": round(timings.loop_ms, 4), "clock": "wall"}
    assert choose_plan(in_graph, probe, "cpu").plan_timings.clock == "cpu"
    plain_only = runners("image", "identity", IMAGE, int(np.prod(IMAGE_SHAPE)))[0]
    assert choose_plan(plain_only, probe).plan_timings is None  # one view: nothing to choose


def test_window_views_fall_back_to_numpy():
    from ttc.testtime.tta import tta_model

    model = tiny_classifier("text", 20)
    assert tta_model(model, build("window:4", TEXT), "mean", 3) is None


def test_merge_rules_match_hand_computed_values():
    from ttc.testtime.tta import merge

    # two samples, two views each (views stacked: sample 0, sample 1, sample 0, sample 1)
    probs = np.array([[0.6, 0.4], [0.2, 0.8], [0.2, 0.8], [0.4, 0.6]], dtype=np.float32)
    owners = np.array([0, 1, 0, 1])
    np.testing.assert_allclose(merge(probs, owners, 2, "mean"), [[0.4, 0.6], [0.3, 0.7]], atol=1e-6)
    g0 = np.sqrt([0.6 * 0.2, 0.4 * 0.8])
    np.testing.assert_allclose(merge(probs, owners, 2, "gmean")[0], g0 / g0.sum(), atol=1e-6)
    np.testing.assert_allclose(merge(probs, owners, 2, "max")[0], [0.6 / 1.4, 0.8 / 1.4], atol=1e-6)
    t0 = np.array([np.sqrt(0.6) + np.sqrt(0.2), np.sqrt(0.4) + np.sqrt(0.8)])
    np.testing.assert_allclose(merge(probs, owners, 2, "tsharpen")[0], t0 / t0.sum(), atol=1e-6)
    vote = merge(probs, owners, 2, "vote")
    assert vote[0].argmax() == 1 and vote[1].argmax() == 1  # tie on sample 0 → higher mean
    irregular = merge(probs[:3], np.array([0, 1, 0]), 2, "mean")  # the general path
    np.testing.assert_allclose(irregular, [[0.4, 0.6], [0.2, 0.8]], atol=1e-6)


def test_every_tta_merge_choice_is_a_merge_rule_and_others_exit_2():
    from config import FIELDS
    from ttc.testtime.tta import merge
    from utils import ConfigError

    probs = np.array([[0.6, 0.4], [0.2, 0.8], [0.2, 0.8], [0.4, 0.6]], dtype=np.float32)
    choices = FIELDS["tta_merge"].metadata["choices"]
    for mode in choices:
        for owners in (None, np.array([0, 1, 0, 1])):
            np.testing.assert_allclose(merge(probs, owners, 2, mode).sum(1), 1, atol=1e-6)
    with pytest.raises(ConfigError) as err:
        merge(probs, None, 2, "median")
    assert err.value.exit_code == 2 and all(mode in err.value.hint for mode in choices)


@pytest.mark.parametrize("kind,pre,x", [
    ("image", IMAGE, np.random.default_rng(8).random((2, *IMAGE_SHAPE)).astype(np.float32)),
    ("text", {**TEXT, "max_length": 8},
     np.array([[5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 0, 0, 0, 0, 0, 0]])),
    ("tabular", TABULAR, np.array([[1.0, 2.0, 1.0], [2.0, 3.0, 0.0]], dtype=np.float32)),
])
def test_every_transform_the_error_lists_is_in_the_help_and_builds_its_example(kind, pre, x):
    """The list of valid transforms, the --tta_transforms help and the builders agree."""
    import re

    from config import FIELDS
    from ttc.testtime.tta import expand, parse_transform_specs, views_per_sample
    from utils import ConfigError

    with pytest.raises(ConfigError) as unknown:
        parse_transform_specs("no_such_transform", kind)
    listed = unknown.value.hint.removeprefix("valid: ").split(", ")
    assert listed[0] == "identity" and len(listed) > 1
    for entry in listed:
        name = entry.removesuffix(":X")
        assert re.search(rf"\b{name}\b", FIELDS["tta_transforms"].metadata["help"]), name
        spec = name
        if entry.endswith(":X"):  # the out-of-range error gives an example: build that
            with pytest.raises(ConfigError) as out_of_range:
                parse_transform_specs(f"{name}:nan", kind)
            spec = out_of_range.value.hint.removeprefix("e.g. ")
        transforms = build(spec, pre)
        stacked, owners = expand(x, transforms)
        np.testing.assert_array_equal(stacked[: len(x)], x)
        if owners is None:
            assert len(stacked) == len(x) * views_per_sample(transforms), spec
        else:  # windows: a view per window of the long text, none for the short one
            assert len(owners) == len(stacked) and list(owners[len(x):]) == [0] * 7, spec


def test_adaptive_threshold_only_touches_uncertain_samples():
    from ttc.testtime.tta import TTARunner

    x = np.random.default_rng(4).random((10, 3, 6, 6)).astype(np.float32)
    calls = []

    def predict(batch):
        calls.append(len(batch))
        confident = batch[:, 0, 0, 0] > 0.5
        return np.where(confident[:, None], [[0.9, 0.1]], [[0.55, 0.45]]).astype(np.float32)

    out = TTARunner(predict, build("hflip", IMAGE), "mean", batch_size=4).run(x, threshold=0.8)
    uncertain = x[:, 0, 0, 0] <= 0.5
    assert list(out.triggered) == list(uncertain)
    np.testing.assert_array_equal(out.probabilities[~uncertain], out.plain[~uncertain])
    assert sum(calls[3:]) == 2 * uncertain.sum() and max(calls) <= 4 * 2  # batch × views


def test_pipeline_tta_report_is_consistent(wine_bundle):
    report = wine_bundle["report"]  # --tta_transforms jitter:0.2,jitter:0.1 --tta_merge gmean
    tta, n = report["tta"], report["dataset"]["test"]
    assert tta["transforms"] == ["jitter:0.2", "jitter:0.1"] and tta["views"] == 3
    assert tta["merge"] == "gmean" and tta["triggered_fraction"] == 1.0
    assert tta["accuracy_plain"] == report["inference"]["accuracy"]
    assert tta["fixed"] - tta["broken"] == round((tta["accuracy"] - tta["accuracy_plain"]) * n)
    assert tta["cost_ratio"] > 1 and tta["accuracy_val"] is not None and tta["verdict"]
    assert tta["backend"] == "onnx_graph" and tta["plan"] in ("graph", "loop")
    timings = tta["plan_timings"]  # --tta_plan auto: both timed on a batch of --batch_size
    assert timings["batch_size"] == 32 and timings["graph_ms"] > 0 and timings["loop_ms"] > 0
    assert tta["plan"] == ("loop" if timings["loop_ms"] < timings["graph_ms"] else "graph")


def test_inference_tta_on_an_existing_bundle_with_threshold_and_either_plan(digits_bundle):
    sections = {}
    for plan in ("auto", "loop"):
        run = run_cli("inference.py", "--model", digits_bundle["model"], "--tta", "true",
                      "--tta_transforms", "shift:1,rotate:10", "--tta_threshold", "0.9",
                      "--tta_plan", plan, "--report_json", "-", "--log_level", "INFO")
        assert run.returncode == 0, run.stderr[-2000:]
        sections[plan] = tta = json.loads(run.stdout)["tta"]
        assert tta["views"] == 7 and 0 < tta["triggered_fraction"] < 1
        assert tta["threshold"] == 0.9
        assert ("TTA lowers" in tta["verdict"]) == (tta["accuracy_val"] < tta["accuracy_val_plain"])
        assert f"TTA plan: {tta['plan']}" in run.stderr
    auto, loop = sections["auto"], sections["loop"]
    assert auto["plan"] in ("graph", "loop") and auto["plan_timings"]["batch_size"] == 64
    assert auto["plan_timings"]["clock"] == "cpu"  # ONNX Runtime on one CPU thread
    assert loop["plan"] == "loop" and loop["plan_timings"] is None  # forced: nothing timed
    same = ("accuracy", "accuracy_plain", "fixed", "broken", "triggered_fraction",
            "accuracy_val", "accuracy_val_plain")
    assert {k: auto[k] for k in same} == {k: loop[k] for k in same}


def test_forced_plans_and_made_up_rows_on_a_bundle(digits_bundle):
    """tta_runner on a real bundle: --tta_plan graph/loop skip the timing, auto times both on
    rows made up from the manifest (no data at hand, as for --input and serve.py), and every
    plan gives the same probabilities."""
    from config import Config
    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.serving.runtime import create_session
    from ttc.testtime.tta import probe_rows, tta_runner

    paths = BundlePaths.from_model_path(digits_bundle["model"])
    manifest = read_manifest(paths)
    rows = probe_rows(None, manifest, 16)
    assert rows.shape == (16, 1, 8, 8) and rows.dtype == np.float32
    outputs = {}
    for plan in ("auto", "graph", "loop"):
        config = Config(output_model=str(paths.onnx), tta=True, tta_transforms="hflip,shift:1",
                        tta_plan=plan, batch_size=16)
        session = create_session(str(paths.onnx), config.runtime())
        runner = tta_runner(session, paths.onnx, manifest, config.tta_options(), config.runtime())
        assert (runner.plan_timings is None) == (plan != "auto")
        assert runner.plan == plan or plan == "auto"
        outputs[plan] = runner(rows)
    np.testing.assert_allclose(outputs["loop"], outputs["graph"], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(outputs["auto"].argmax(1), outputs["graph"].argmax(1))


def test_made_up_token_ids_avoid_padding_and_special_ids():
    from types import SimpleNamespace

    from ttc.testtime.tta import probe_rows

    pre = {"kind": "text", "max_length": 128, "vocab_size": 50, "pad_id": 1, "unk_id": 3,
           "special_ids": [0, 1, 2, 3]}
    manifest = SimpleNamespace(preprocessing=SimpleNamespace(spec=pre),
                               input=SimpleNamespace(pad_id=1, shape=("batch", "length")))
    ids = probe_rows(None, manifest, 8)
    assert ids.shape == (8, 32) and ids.dtype == np.int64
    assert ids.min() >= 3 and ids.max() < 50 and not np.isin(ids, [0, 1, 2]).any()
    given = np.array([[5, 6, 1, 1], [7, 1, 1, 1]])
    np.testing.assert_array_equal(probe_rows(given, manifest, 3), [[5, 6], [7, 1], [5, 6]])


@pytest.mark.parametrize("args,phrase", [
    (["--tta_transforms", "mirror"], "unknown TTA transform 'mirror'"),
    (["--tta_transforms", "rotate"], "needs a parameter"),
    (["--tta_transforms", "crop:2"], "fraction in (0, 1)"),
    (["--tta_transforms", "token_dropout:0.1"], "valid: identity, hflip"),
    (["--tta_merge", "median"], "--tta_merge"),
    (["--tta_threshold", "1.5"], "--tta_threshold"),
])
def test_bad_tta_flags_exit_2(tmp_path, args, phrase):
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--output_model",
                  tmp_path / "m.onnx", "--tta", "true", *args)
    assert_clean_failure(run, 2, phrase)


def test_transform_of_another_model_type_exits_2(tmp_path):
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:iris", "--output_model", tmp_path / "m.onnx", "--tta", "true",
                  "--tta_transforms", "hflip")
    assert_clean_failure(run, 2, "for tabular models", "jitter:X")


# ----------------------------------------------------------------------------- one vocabulary

GEOMETRIC = ["hflip", "vflip", "rot90", "rot180", "rot270", "shift:2"]


def views_of(spec, output):
    from ttc.testtime.transforms import image_views, parse_transform_specs

    kind = {"mask": "segmentation", "boxes": "detection"}[output]
    return image_views(parse_transform_specs(spec, kind), output)[1:]


def rectangle(height=14, width=22, box=(3, 2, 13, 6)):
    """A (1, 1, H, W) image of zeros with ones inside the xyxy `box` (pixel edges)."""
    import torch

    image = torch.zeros(1, 1, height, width)
    x1, y1, x2, y2 = box
    image[..., y1:y2, x1:x2] = 1.0
    return image


def box_in(image):
    """The xyxy box (pixel edges) around the pixels above 0.5, as (1, 1, 4)."""
    import torch

    ys, xs = torch.nonzero(image[0, 0] > 0.5, as_tuple=True)
    return torch.tensor([[[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]]], dtype=torch.float32)


@pytest.mark.parametrize("spec", GEOMETRIC)
def test_a_geometric_view_s_mask_comes_back_onto_the_original_pixels(spec):
    """A per-pixel 'model' that returns its input: each view's planes, de-augmented, are the
    original's (non-square, so a quarter turn's view has the other shape); a shift's border
    rows, replicated in the view, are the only pixels left out."""
    import torch

    x = torch.rand(2, 3, 9, 13)
    for view in views_of(spec, "mask"):
        seen = view.augment(x)
        assert seen.shape[-2:] == ((13, 9) if spec in ("rot90", "rot270") else (9, 13))
        back = view.deaugment_mask(seen, x.shape[-2:])
        inner = (slice(None),) * 2 + ((slice(2, -2),) * 2 if spec == "shift:2" else ())
        torch.testing.assert_close(back[inner], x[inner], rtol=0, atol=0)
        assert not torch.equal(seen, x)


def test_a_rescaled_mask_comes_back_at_the_original_size():
    import torch

    x = torch.full((1, 2, 9, 13), 0.25)
    for view in views_of("scale:0.5,1.5", "mask"):
        seen = view.augment(x)
        assert seen.shape[-2:] != x.shape[-2:]
        torch.testing.assert_close(view.deaugment_mask(seen, x.shape[-2:]), x)


@pytest.mark.parametrize("spec", [*GEOMETRIC, "scale:2"])
def test_a_view_s_boxes_come_back_onto_the_original_pixels(spec):
    """The box around a drawn rectangle, found in each view and mapped back, is the
    rectangle's box in the original (the rectangle off-centre, the image not square)."""
    image = rectangle()
    for view in views_of(spec, "boxes"):
        seen = view.augment(image)
        found = box_in(seen)
        assert found.tolist() != [[[3, 2, 13, 6]]]
        back = view.deaugment_boxes(found, seen.shape[-2:], image.shape[-2:])
        assert back.tolist() == [[[3, 2, 13, 6]]], (spec, view.setting)


@pytest.mark.parametrize("spec", ["brightness:0.2", "contrast:1.5"])
def test_a_photometric_view_moves_nothing(spec):
    import torch

    x = torch.rand(2, 1, 9, 13)
    planes, boxes = torch.rand(2, 3, 9, 13), torch.rand(2, 5, 4) * 9
    for output in ("mask", "boxes"):
        for view in views_of(spec, output):
            seen = view.augment(x)
            assert not torch.equal(seen, x) and 0 <= seen.min() and seen.max() <= 1
            assert torch.equal(view.deaugment_mask(planes, x.shape[-2:]), planes)
            assert torch.equal(view.deaugment_boxes(boxes, (9, 13), (9, 13)), boxes)


def test_the_numpy_and_torch_augmentations_agree():
    """One class, one augmentation: a classifier's numpy view and a segmenter's torch view."""
    import torch

    x = np.random.default_rng(3).random((2, 1, 6, 6)).astype(np.float32)
    for spec in ("hflip", "vflip", "rot90", "rot270", "shift:1", "brightness:0.1", "contrast:2"):
        numpy_views = build(spec, {**IMAGE, "channels": 1})[0].views(x)
        torch_views = [v.augment(torch.from_numpy(x)).numpy() for v in views_of(spec, "mask")]
        for a, b in zip(numpy_views, torch_views, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6)


def test_every_transform_maps_each_output_back_or_says_why():
    from ttc.testtime.transforms import OUTPUTS, TRANSFORMS, accepted

    for cls in TRANSFORMS:
        assert set(cls.cannot) <= set(OUTPUTS) and all(len(why) > 20 for why in cls.cannot.values())
    for kind in ("segmentation", "detection"):
        names = set(accepted(kind))
        assert {"hflip", "vflip", "rot90", "rot180", "rot270", "shift", "scale", "brightness",
                "contrast"} <= names
        assert not names & {"rotate", "crop", "token_dropout", "window", "jitter"}
    assert set(accepted("image")) >= {"rot90", "rotate", "crop", "shift", "scale"}


def test_rot90_runs_on_a_classifier_bundle(digits_bundle):
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--tta", "true",
                  "--tta_transforms", "rot90", "--report_json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    tta = json.loads(run.stdout)["tta"]
    assert tta["transforms"] == ["rot90"] and tta["views"] == 2
