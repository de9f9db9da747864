"""Test-time compute on Hugging Face bundles (--arch hf:...): token-level TTA through the
attention mask, Tent over LayerNorm (bn does not apply), MC-dropout on a graph with three
inputs, and ensembles; with the usual pad id 0 and with a tokenizer whose pad id is 1."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ttc.testtime.calibrate import rescale, softmax
from conftest import assert_clean_failure, run_cli, topic_texts

CLS, SEP, PAD1, UNK = 2, 3, 1, 0
# the preprocessing of tiny_hf_model(..., pad_token="<pad>"): [UNK] 0, <pad> 1, [CLS] 2, ...
PAD1_TEXT = {"kind": "text", "tokenizer": "huggingface", "pad_id": PAD1, "unk_id": UNK,
             "special_ids": [0, 1, 2, 3, 4], "max_length": 16}


def pad1_ids() -> np.ndarray:
    """[CLS] tokens [SEP] right-padded with 1; the second text holds an unknown token (0),
    which counts as real, the third one real token only."""
    return np.array([[CLS, 7, 8, 9, 10, 11, 12, SEP, PAD1, PAD1],
                     [CLS, 20, UNK, 21, SEP, PAD1, PAD1, PAD1, PAD1, PAD1],
                     [CLS, 30, SEP, PAD1, PAD1, PAD1, PAD1, PAD1, PAD1, PAD1]], dtype=np.int64)


def assert_specials_in_place(plain: np.ndarray, view: np.ndarray) -> None:
    """Special tokens and padding where they were; every other place the token or padding;
    every text keeps at least one real token."""
    special = np.isin(plain, [CLS, SEP, PAD1])
    np.testing.assert_array_equal(view[special], plain[special])
    assert ((view == plain) | (view == PAD1)).all()
    assert (((view != PAD1) & ~np.isin(view, [CLS, SEP])).sum(1) >= 1).all()


def bundle_ids(bundle: dict) -> tuple[dict, np.ndarray]:
    """The bundle's manifest and its data's texts tokenized as the bundle does."""
    from ttc.inputs.preprocess import text_tokenizer
    from ttc.serving.bundle import BundlePaths, read_manifest

    manifest = read_manifest(BundlePaths.from_model_path(bundle["model"]))
    texts = [t for t, _ in topic_texts()][:40]
    return manifest, text_tokenizer(manifest.preprocessing.spec).encode_batch(texts)


# ----------------------------------------------------------------------------- numpy and graph views


def test_token_views_drop_real_tokens_only_into_the_bundle_padding():
    from ttc.testtime.tta import build_transforms, expand, random_augment

    ids = pad1_ids()
    stacked, owners = expand(ids, build_transforms("token_dropout:0.5,token_dropout:0.99",
                                                   PAD1_TEXT, seed=3))
    assert owners is None and stacked.shape == (9, ids.shape[1])
    for view in (stacked[3:6], stacked[6:]):
        assert_specials_in_place(ids, view)
    # at 0.99 only the first real token of each text is left, between [CLS] and [SEP]
    np.testing.assert_array_equal(stacked[6:, :2], ids[:, :2])
    assert set(stacked[6:, 2:].ravel()) == {SEP, PAD1} and ((stacked[6:] == SEP).sum(1) == 1).all()
    assert (stacked[3:6] == PAD1).sum() > (ids == PAD1).sum()  # 0.5 dropped some
    # training's random forms (classifier_loop.py's random_augment) keep the same rules
    many = np.repeat(ids, 20, 0)
    augmented = random_augment(many, build_transforms("token_dropout:0.5,window:2", PAD1_TEXT),
                               np.random.default_rng(0))
    assert augmented.shape == many.shape and (augmented != many).any()
    for plain, row in zip(many, augmented):
        used = row[row != PAD1]
        assert used[0] == CLS and used[-1] == SEP and 3 <= len(used)
        assert set(used[1:-1]) <= set(plain[1:-1]) - {SEP, PAD1}
        assert (row[np.flatnonzero(row == SEP)[0] + 1:] == PAD1).all()


def test_windows_keep_the_special_tokens_and_pad_with_the_bundle_pad_id():
    from ttc.testtime.tta import build_transforms, expand

    stacked, owners = expand(pad1_ids(), build_transforms("window:4", PAD1_TEXT))
    assert list(owners) == [0, 1, 2, 0, 0]  # the 6-token text: windows [0:4] and [2:6]
    np.testing.assert_array_equal(stacked[3:, :6], [[CLS, 7, 8, 9, 10, SEP],
                                                    [CLS, 9, 10, 11, 12, SEP]])
    assert (stacked[3:, 6:] == PAD1).all()


def three_input_classifier(pad_id: int, classes: int = 3, vocab: int = 40):
    """An ONNX graph shaped like an exported hf model: input_ids, attention_mask and
    token_type_ids in, the masked sum of token (and token type) embeddings as logits."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    names = ("input_ids", "attention_mask", "token_type_ids")
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "length"])
              for n in names]
    nodes = [helper.make_node("Gather", ["tokens", "input_ids"], ["embedded"]),
             helper.make_node("Gather", ["types", "token_type_ids"], ["typed"]),
             helper.make_node("Add", ["embedded", "typed"], ["summed"]),
             helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["mask_f", "last"], ["mask3"]),
             helper.make_node("Mul", ["summed", "mask3"], ["masked"]),
             helper.make_node("ReduceSum", ["masked", "axis1"], ["logits"], keepdims=0),
             helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1)]
    weights = [numpy_helper.from_array(rng.standard_normal((vocab, classes)).astype(np.float32),
                                       "tokens"),
               numpy_helper.from_array(rng.standard_normal((2, classes)).astype(np.float32),
                                       "types"),
               numpy_helper.from_array(np.array([-1], np.int64), "last"),
               numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", classes])
               for n in ("logits", "probabilities")]
    model = helper.make_model(helper.make_graph(nodes, "hf_like", inputs, outputs, weights),
                              opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.helper.set_model_props(model, {"padding_id": str(pad_id)})
    return model


def test_in_graph_token_dropout_on_a_three_input_graph_equals_the_numpy_views():
    """The TTA graph derives each view's attention mask and token types from its own ids, so
    it takes input_ids alone, and gives what numpy views fed through the graph's feeder do."""
    import onnxruntime as ort
    from ttc.serving.runtime import session_feeder, session_runner
    from ttc.testtime.tta import TTARunner, build_transforms, tta_model

    for pad_id, pre in ((1, PAD1_TEXT), (0, {**PAD1_TEXT, "pad_id": 0, "unk_id": 1,
                                             "special_ids": [0, 1, 2, 3]})):
        ids = np.where(pad1_ids() == PAD1, pad_id, pad1_ids())
        ids[1, 2] = pre["unk_id"]
        model = three_input_classifier(pad_id)
        transforms = build_transforms("token_dropout:0.5,token_dropout:0.3", pre, seed=5)
        plain = ort.InferenceSession(model.SerializeToString(),
                                     providers=["CPUExecutionProvider"])
        merged = ort.InferenceSession(tta_model(model, transforms, "mean", 3).SerializeToString(),
                                      providers=["CPUExecutionProvider"])
        assert [i.name for i in merged.get_inputs()] == ["input_ids"]
        feed = session_feeder(plain)
        predict = lambda b: plain.run(["probabilities"], feed(b))[0]  # noqa: E731
        in_graph = TTARunner(predict, transforms, "mean", 6, session_runner(merged))
        numpy_views = TTARunner(predict, transforms, "mean", 6)
        np.testing.assert_allclose(in_graph(ids), numpy_views(ids), atol=1e-6)
        assert not np.allclose(in_graph(ids), predict(ids), atol=1e-3)  # the views did count


def test_text_shifts_leave_special_tokens_and_use_the_bundle_ids():
    from ttc.inputs.shifts import corrupt

    ids = np.repeat(pad1_ids(), 30, 0)
    unknown = corrupt(ids, "unknown_tokens", 5, PAD1_TEXT, seed=0)
    special = np.isin(ids, [CLS, SEP, PAD1])
    np.testing.assert_array_equal(unknown[special], ids[special])
    assert ((unknown == ids) | (unknown == UNK)).all() and (unknown != ids).any()
    deleted = corrupt(ids, "token_deletion", 5, PAD1_TEXT, seed=0)
    assert (deleted[:, 0] == CLS).all() and ((deleted == SEP).sum(1) == 1).all()
    for plain, row in zip(ids, deleted):
        used = row[row != PAD1]  # [CLS] kept tokens [SEP], then only padding
        assert used[-1] == SEP and len(used) >= 3 and (row[len(used):] == PAD1).all()
        kept = list(used[1:-1])
        assert kept[0] == plain[1] and all(t in plain for t in kept)  # first real token stays
    assert (deleted == PAD1).sum() > (ids == PAD1).sum()


# ----------------------------------------------------------------------------- real bundles


def test_pipeline_on_a_pad_id_1_bundle_reports_tta_tent_and_the_ensemble(hf_pad1_bundle):
    report = hf_pad1_bundle["report"]
    tta = report["tta"]
    assert tta["backend"] == "onnx_graph" and tta["views"] == 3
    assert 0.8 <= tta["accuracy_plain"] and abs(tta["accuracy"] - tta["accuracy_plain"]) <= 0.1
    ttt = report["ttt"]
    assert ttt["method"] == "tent" and ttt["not_applicable"] == {}
    assert [r["name"] for r in ttt["shifts"]] == ["unknown_tokens", "token_deletion"]
    for row in [ttt["clean"], *ttt["shifts"]]:
        assert row["accuracy_tent"] is not None and row["accuracy_bn"] is None
        assert abs(row["accuracy_tent"] - row["accuracy_source"]) <= 0.1
    iterative = report["iterative"]
    assert iterative["mode"] == "ensemble"
    assert [r["variant"] for r in iterative["rows"]] == ["single", "single+T", "ensemble",
                                                         "ensemble+T"]
    assert iterative["rows"][2]["passes_used"] == 3 and iterative["rows"][2]["accuracy"] >= 0.8
    manifest = json.loads((hf_pad1_bundle["dir"] / "model.json").read_text())
    assert manifest["preprocessing"]["pad_id"] == 1
    assert {"mc", "ensemble"} <= set(manifest["extra_graphs"])


def test_ensemble_graph_takes_the_hf_inputs_and_averages_its_members(hf_pad1_bundle):
    import onnxruntime as ort
    from ttc.serving.runtime import session_feeder

    manifest, ids = bundle_ids(hf_pad1_bundle)
    session = ort.InferenceSession(str(hf_pad1_bundle["dir"] / "model.ensemble.onnx"),
                                   providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask",
                                                      "token_type_ids"]
    mean, members = session.run(["probabilities", "pass_probabilities"],
                                session_feeder(session)(ids))
    assert members.shape == (3, len(ids), 3)
    temperature = manifest.extra_graphs.ensemble.temperature  # after the average
    np.testing.assert_allclose(mean, rescale(members.mean(0), temperature), atol=1e-6)
    single = ort.InferenceSession(str(hf_pad1_bundle["model"]),
                                  providers=["CPUExecutionProvider"])
    logits = single.run(["logits"], session_feeder(single)(ids))[0]
    np.testing.assert_allclose(members[0], softmax(logits), atol=1e-5)  # member 1, uncalibrated


def test_mc_dropout_backends_and_window_tta_on_a_pad_id_1_bundle(hf_pad1_bundle, tmp_path):
    """Every MC-dropout backend on a graph with three inputs: python and loop draw the same
    masks, batched other ones; window TTA (numpy views) in the same runs."""
    rows = {}
    for backend in ("python", "loop", "batched"):
        out = tmp_path / f"{backend}.json"
        run = run_cli("inference.py", "--model", hf_pad1_bundle["model"], "--dataset_path",
                      hf_pad1_bundle["dir"] / "texts.csv", "--iterative", "mc_dropout",
                      "--iterative_backend", backend, "--iterations", "8",
                      "--num_threads", "1", "--report_json", out,
                      *(("--tta", "true", "--tta_transforms", "window:3,token_dropout:0.2")
                        if backend == "batched" else ()))
        assert run.returncode == 0, run.stderr[-3000:]
        report = json.loads(out.read_text())
        assert [r["variant"] for r in report["iterative"]["rows"]] == [
            "single", "single+T", "mc_dropout", "mc_dropout+T"]
        rows[backend] = report["iterative"]["rows"][2]
    assert rows["python"]["nll"] == pytest.approx(rows["loop"]["nll"], abs=1e-5)
    assert rows["batched"]["nll"] != rows["python"]["nll"]  # other masks ...
    assert rows["batched"]["accuracy"] == pytest.approx(rows["python"]["accuracy"], abs=0.1)
    tta = report["tta"]
    assert tta["backend"] == "numpy" and tta["views"] == 3 and tta["accuracy"] >= 0.8


def test_tent_adapts_the_hf_layernorms_and_bn_does_not_apply(hf_bundle, tmp_path):
    out = tmp_path / "ttt.json"
    run = run_cli("inference.py", "--model", hf_bundle["model"], "--dataset_path",
                  hf_bundle["dir"] / "texts.csv", "--ttt", "true",
                  "--ttt_method", "all", "--eval_shift", "token_deletion", "--num_threads", "1",
                  "--report_json", out)
    assert run.returncode == 0, run.stderr[-3000:]
    ttt = json.loads(out.read_text())["ttt"]
    assert "LayerNorm" in ttt["not_applicable"]["bn"]
    for row in (ttt["clean"], ttt["shifts"][0]):
        assert row["accuracy_bn"] is None and row["accuracy_tent"] is not None
        assert row["cost_ratio_tent"] > 0
    for script in ("inference.py", "pipeline.py"):
        args = (("--model", hf_bundle["model"]) if script == "inference.py" else
                ("--model_type", "text_classifier", "--dataset_path",
                 hf_bundle["dir"] / "texts.csv", "--arch", "hf:whatever", "--output_model",
                 tmp_path / "never" / "model.onnx"))
        assert_clean_failure(run_cli(script, *args, "--ttt", "true", "--ttt_method", "bn"), 2,
                             "--ttt_method bn", "LayerNorm", "tent")


def test_tent_pairs_every_hf_layernorm_when_slimming_merged_their_parameters(hf_bundle):
    """A BERT whose LayerNorms all hold ones and zeros (never trained) exports with one shared
    scale and bias, named after the embeddings' LayerNorm: Tent gives each node its own copy and
    pairs the PyTorch layers with the nodes in order."""
    import torch
    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.convert.tracing import export_graph, slim_graph
    from ttc.nets.models import load_weights
    from ttc.testtime.ttt import affine_norm_model, paired_norm_modules

    torch.set_num_threads(1)
    paths = BundlePaths.from_model_path(hf_bundle["model"])
    manifest = read_manifest(paths)
    net = load_weights(manifest, paths.weights).eval()
    norms = [m for m in net.modules() if isinstance(m, torch.nn.LayerNorm)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.fill_(1.0)
            norm.bias.zero_()
    _, ids = bundle_ids(hf_bundle)
    graph = slim_graph(export_graph(net, ids[:4], 18, manifest.input,
                                    ["logits", "probabilities"]))
    _, layers = affine_norm_model(graph)
    assert len(layers) == len(norms) == 5 and len({layer.scale for layer in layers}) == 5
    assert paired_norm_modules(net, layers) == norms


def test_tent_parameters_fed_into_the_hf_graph_give_the_adapted_network(hf_pad1_bundle):
    """Tent's steps move the LayerNorm parameters of the PyTorch copy; fed into model.onnx by
    name (with the attention mask built from pad id 1) they give that network's probabilities."""
    import onnx
    import torch
    from ttc.serving.bundle import BundlePaths
    from ttc.serving.runtime import RuntimeOptions, create_session
    from ttc.testtime.ttt import AdaptationGraph, Tent

    paths = BundlePaths.from_model_path(hf_pad1_bundle["model"])
    manifest, ids = bundle_ids(hf_pad1_bundle)
    graph = AdaptationGraph(onnx.load(str(paths.onnx)),
                            lambda m: create_session(m, RuntimeOptions()))
    tent = Tent(manifest, paths.weights, graph.layers, 5e-3, 3)
    assert len(graph.layers) == 5 and graph.not_applicable["bn"].endswith("LayerNorm)")
    source, _ = graph.run(ids, 0.0, {})
    adapted, _ = graph.run(ids, 0.0, tent.adapt(ids))
    with torch.no_grad():
        temperature = manifest.calibration.temperature  # baked into model.onnx
        expected = torch.softmax(tent.net(torch.from_numpy(ids)) / temperature, 1).numpy()
    np.testing.assert_allclose(adapted, expected, atol=1e-5)
    assert np.abs(adapted - source).max() > 1e-3  # the steps moved the predictions
    # towards lower entropy: Tent's objective, the mean entropy of the served probabilities
    # (a row's top probability may fall while the batch's entropy falls)
    assert mean_entropy(adapted) < mean_entropy(source)


def mean_entropy(probabilities: np.ndarray) -> float:
    return float(-(probabilities * np.log(np.clip(probabilities, 1e-12, 1))).sum(1).mean())
