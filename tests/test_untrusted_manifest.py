"""Untrusted manifests, graphs and tokenizers (issue 37, problems 8 and 5): a bundle is written
by whoever made it, and its hashes catch accidents, not an attacker (these tests recompute them
as one would). A manifest field of another type, out of range or nested too deep, sections that
disagree, a graph file that is not ONNX, graph metadata the manifest contradicts, a graph that
computes another number of classes than the manifest has labels, external data named inside a
model-local function, a malformed tokenizer.json or one whose regex panics the Rust tokenizers
library: each is exit 4 with one line naming what is wrong, never a traceback, never exit 5's
"report it"."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import assert_clean_failure, copy_bundle, edit_manifest, run_cli

TIMEOUT = 120


# ----------------------------------------------------------------------------- building





def graph_file(model: Path, key: str) -> Path:
    return model if key == "onnx" else model.with_suffix(f".{key}.onnx")


def put_graph(model: Path, key: str, data: bytes) -> None:
    """Replace a graph file and its sha256 in the manifest, as an attacker would."""
    graph_file(model, key).write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    edit_manifest(model, lambda m: m["files"]["sha256"].update({key: digest}))


def restamp(model: Path) -> None:
    """After editing the labels, input or preprocessing: stamp every graph with the edited
    manifest's contract (bundle.stamp_contract), and their hashes, as an attacker would."""
    from ttc.serving.bundle import CONTRACT_KEY, contract_digest

    digest = contract_digest(json.loads(model.with_suffix(".json").read_text()))
    for key in ("onnx", "bn", "mc"):
        if graph_file(model, key).exists():
            graph = onnx.load(str(graph_file(model, key)))
            for entry in graph.metadata_props:
                if entry.key == CONTRACT_KEY:
                    entry.value = digest
            put_graph(model, key, graph.SerializeToString())


def put_tokenizer(model: Path, text: str) -> None:
    """Replace an hf bundle's tokenizer.json, its sha256 in the manifest and the graphs' stamp."""
    model.with_suffix(".tokenizer.json").write_text(text)
    digest = hashlib.sha256(text.encode()).hexdigest()

    def change(manifest: dict) -> None:
        manifest["files"]["sha256"]["tokenizer"] = digest
        manifest["preprocessing"]["sha256"] = digest

    edit_manifest(model, change)
    restamp(model)


def one_image(folder: Path) -> Path:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8), 128, np.uint8)).save(folder / "one.png")
    return folder


def predict(model: Path, inputs: Path, tmp_path: Path, *flags: str):
    return run_cli("inference.py", "--model", model, "--input", inputs, "--output",
                   tmp_path / "preds.csv", *flags, timeout=TIMEOUT)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# ----------------------------------------------------------------------------- the manifest

# (bundle, change, phrase): every field by type and range, nesting, and sections that disagree
MANIFESTS = [
    ("digits", lambda m: m.update(export=json.loads(nested(40))), "nested deeper than 32"),
    ("digits", lambda m: m.update(dataset=[]), "dataset must be an object, not []"),
    ("digits", lambda m: m.pop("dataset"), "the key 'dataset' is missing"),
    ("digits", lambda m: m["dataset"].update(has_header=1), "dataset.has_header must be one of"),
    ("digits", lambda m: m["dataset"].update(val_fraction=2), "dataset.val_fraction must be"),
    ("digits", lambda m: m["dataset"].update(columns={"label": 5, "inputs": []}),
     "dataset.columns.label must be a string, not 5"),
    ("digits", lambda m: m["dataset"].update(train_class_counts={"0": 1}),
     "dataset.train_class_counts must be a list"),
    ("digits", lambda m: m["dataset"].update(train_class_counts=[5] * 11),
     "dataset.train_class_counts has 11 entries for 10 labels"),
    ("digits", lambda m: m["preprocessing"].update(image_size=[8]),
     "preprocessing.image_size must be a list of 2 entries"),
    ("digits", lambda m: m["preprocessing"].update(std=[0.0]),
     "preprocessing.std[0] must be a number above 0"),
    ("digits", lambda m: m["architecture"].update(widths=[32, "64"]),
     "architecture.widths[1] must be an integer"),
    ("digits", lambda m: m["architecture"].update(dropout=1.5), "architecture.dropout must be"),
    ("digits", lambda m: m["architecture"].update(name="Evil"), "architecture.name must be one"),
    ("digits", lambda m: m["architecture"].update(mean=[0.5]),
     "architecture.mean is not a field"),
    ("digits", lambda m: m["calibration"].update(method=5), "calibration.method must be a string"),
    ("digits", lambda m: m["extra_graphs"]["mc"].update(temperature=-1),
     "extra_graphs.mc.temperature must be a number above 0"),
    ("digits", lambda m: m.update(quantization={"used_for_inference": "yes"}),
     "quantization.used_for_inference must be true or false"),
    ("digits", lambda m: m.update(outputs=[{"name": "scores"}]), "outputs[0].name must be one of"),
    ("digits", lambda m: m["input"].update(dtype="float64"), "input.dtype must be one of"),
    ("text", lambda m: m["preprocessing"].update(vocabulary="abc"),
     "preprocessing.vocabulary must be a list, not 'abc'"),
    ("text", lambda m: m["preprocessing"].update(min_count=-1), "preprocessing.min_count must be"),
    ("text", lambda m: m["preprocessing"].update(bigrams=1), "preprocessing.bigrams must be true"),
    ("text", lambda m: m["architecture"].update(num_classes=True),
     "architecture.num_classes must be an integer"),
    ("hf", lambda m: m["preprocessing"].update(special_ids=["[CLS]"]),
     "preprocessing.special_ids[0] must be an integer"),
    ("hf", lambda m: m["preprocessing"].update(pad_id=2**40), "preprocessing.pad_id must be"),
    ("hf", lambda m: m["preprocessing"].update(graph_inputs=["input_ids", "evil"]),
     "preprocessing.graph_inputs[1] must be one of"),
    ("hf", lambda m: m["architecture"].update(hf_config="bert"),
     "architecture.hf_config must be an object"),
]


@pytest.mark.parametrize("bundle,change,phrase", MANIFESTS,
                         ids=[f"{b}-{p.split()[0]}" for b, _, p in MANIFESTS])
def test_a_manifest_field_of_another_type_or_range_is_exit_4(request, tmp_path, bundle, change,
                                                             phrase):
    model = copy_bundle(request.getfixturevalue(f"{bundle}_bundle"), tmp_path / "b")
    edit_manifest(model, change)
    run = run_cli("inference.py", "--model", model, timeout=TIMEOUT)
    assert_clean_failure(run, 4, "model.json", phrase)


@pytest.mark.parametrize("depth", [2_000, 200_000])
def test_a_manifest_nested_past_the_parser_is_exit_4(digits_bundle, tmp_path, depth):
    model = copy_bundle(digits_bundle, tmp_path / "b")
    text = model.with_suffix(".json").read_text().rstrip()
    model.with_suffix(".json").write_text(text[:-1] + f', "training": {nested(depth)}}}')
    run = run_cli("inference.py", "--model", model, timeout=TIMEOUT)
    assert_clean_failure(run, 4, "model.json is JSON nested deeper than 32 levels")


@pytest.mark.parametrize("change,phrase", [
    (lambda c: c.update(model_type="evil"), "Unrecognized model identifier: evil"),
    (lambda c: c.update(id2label={"0": "a"}, label2id={"a": 0}), "1 outputs for 3 classes"),
], ids=["model_type", "labels"])
def test_an_hf_config_transformers_cannot_build_is_exit_4(hf_bundle, tmp_path, change, phrase):
    """architecture.hf_config goes to transformers when export.py (or Tent) rebuilds the
    network."""
    model = copy_bundle(hf_bundle, tmp_path / "b")
    edit_manifest(model, lambda m: change(m["architecture"]["hf_config"]))
    run = run_cli("export.py", "--output_model", model, "--dataset_path",
                  hf_texts(tmp_path, "rain and wind"), timeout=TIMEOUT)
    assert_clean_failure(run, 4, "the bundle's architecture.hf_config", phrase)


def test_sections_that_disagree_are_refused_after_the_graph_agrees(text_bundle, tmp_path):
    """The vocabulary edited and every graph stamped for it again: the graph check passes, and
    the preprocessing's own sizes do not agree."""
    model = copy_bundle(text_bundle, tmp_path / "b")
    edit_manifest(model, lambda m: m["preprocessing"]["vocabulary"].append("extra"))
    restamp(model)
    run = run_cli("inference.py", "--model", model, timeout=TIMEOUT)
    assert_clean_failure(run, 4, "preprocessing.vocab_size is", "plus padding and unknown")


# ----------------------------------------------------------------------------- the graphs

@pytest.mark.parametrize("key,data,flags", [
    ("mc", b"this is not a protobuf", ("--iterative", "mc_dropout", "--iterations", "2")),
    ("bn", bytes(range(256)) * 8, ("--ttt", "true", "--ttt_method", "bn")),
])
def test_a_graph_file_that_is_not_onnx_is_exit_4(digits_bundle, tmp_path, key, data, flags):
    model = copy_bundle(digits_bundle, tmp_path / "b")
    put_graph(model, key, data)
    run = predict(model, one_image(tmp_path / "in"), tmp_path, *flags)
    assert_clean_failure(run, 4, f"model.{key}.onnx: it is not an ONNX model")


def classes_graph(model: Path, computed: int, declared: int | str) -> bytes:
    """A graph with the bundle's input that computes `computed` classes and declares `declared`
    (a number, or a symbolic axis), its metadata (the contract stamp) kept."""
    original = onnx.load(str(model))
    weights = np.random.default_rng(0).random((64, computed), np.float32)
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["image"], ["flat"]),
         helper.make_node("MatMul", ["flat", "w"], ["logits"]),
         helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1)], "g",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 1, 8, 8])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", declared])
         for name in ("logits", "probabilities")],
        [onnx.numpy_helper.from_array(weights, "w")])
    made = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                             ir_version=original.ir_version)
    made.metadata_props.extend(original.metadata_props)
    return made.SerializeToString()


@pytest.mark.parametrize("computed,declared,flags,phrases", [
    (4, "classes", (), ["model.onnx computes 4 classes", "10 labels"]),
    (3, 10, (), ["model.onnx computes 3 classes", "10 labels"]),
    # the TTA graph built around it reshapes by the manifest's classes, which fails in there
    (12, "classes", ("--tta", "true", "--tta_plan", "graph"),
     ["ONNX Runtime cannot run", "model.onnx", "Reshape"]),
    # with the plan chosen at load, timing the loop plan runs the plain graph first, whose
    # output the class count check sees
    (12, "classes", ("--tta", "true"), ["model.onnx computes 12 classes", "10 labels"]),
])
def test_a_graph_computing_other_classes_than_the_labels_is_exit_4(digits_bundle, tmp_path,
                                                                   computed, declared, flags,
                                                                   phrases):
    """The class axis symbolic, or declared as the manifest's 10 and computed otherwise: seen
    in the run's real output."""
    model = copy_bundle(digits_bundle, tmp_path / "b")
    put_graph(model, "onnx", classes_graph(model, computed, declared))
    run = predict(model, one_image(tmp_path / "in"), tmp_path, *flags)
    assert_clean_failure(run, 4, *phrases)
    assert not (tmp_path / "preds.csv").exists()


@pytest.mark.parametrize("value", ["abc", "1", " 0", "9" * 5000])
def test_graph_metadata_the_manifest_contradicts_is_exit_4(hf_bundle, tmp_path, value):
    model = copy_bundle(hf_bundle, tmp_path / "b")
    graph = onnx.load(str(model))
    for entry in graph.metadata_props:
        if entry.key == "padding_id":
            entry.value = value
    put_graph(model, "onnx", graph.SerializeToString())
    inputs = tmp_path / "texts.csv"
    inputs.write_text("text\nrain and wind today\n")
    run = predict(model, inputs, tmp_path)
    assert_clean_failure(run, 4, "does not match the graph model.onnx",
                         "metadata's padding_id", "the input's padding id 0")


def external_constant(location: str) -> onnx.TensorProto:
    tensor = helper.make_tensor("hidden", TensorProto.FLOAT, [16], np.zeros(16, np.float32))
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", location
    return tensor


def function_with_external_data(location: str) -> onnx.FunctionProto:
    node = helper.make_node("Constant", [], ["y"], value=external_constant(location))
    return helper.make_function("hidden.domain", "Hidden", ["x"], ["y"], [node],
                                [helper.make_opsetid("", 18)])


def sparse_with_external_data(location: str) -> onnx.SparseTensorProto:
    indices = helper.make_tensor("hidden_indices", TensorProto.INT64, [1], [0])
    return helper.make_sparse_tensor(external_constant(location), indices, [16])


@pytest.mark.parametrize("key,where,flags", [
    ("onnx", "function", ()),
    ("mc", "function", ("--iterative", "mc_dropout", "--iterations", "2")),
    ("onnx", "sparse", ()),
])
def test_external_data_named_anywhere_in_a_model_is_refused_unread(digits_bundle, tmp_path,
                                                                   key, where, flags):
    """A model-local function's nodes and a sparse initializer hold tensors too: their external
    data outside the folder is refused before onnx or ONNX Runtime opens it."""
    model = copy_bundle(digits_bundle, tmp_path / "b")
    decoy = tmp_path / "decoy.bin"
    decoy.write_bytes(np.arange(16, dtype=np.float32).tobytes())
    os.utime(decoy, (0, decoy.stat().st_mtime))
    graph = onnx.load(str(graph_file(model, key)))
    if where == "function":
        graph.functions.append(function_with_external_data("../decoy.bin"))
    else:
        graph.graph.sparse_initializer.append(sparse_with_external_data("../decoy.bin"))
    put_graph(model, key, graph.SerializeToString())
    run = predict(model, one_image(tmp_path / "in"), tmp_path, *flags)
    assert_clean_failure(run, 4, f"model.{key}.onnx refused" if key != "onnx" else
                         "model.onnx refused", "reads external data from '../decoy.bin'")
    control = tmp_path / "control.bin"
    control.write_bytes(b"x")
    os.utime(control, (0, control.stat().st_mtime))
    control.read_bytes()
    if control.stat().st_atime != 0:  # this file system records reads: the decoy had none
        assert decoy.stat().st_atime == 0, "the decoy beside the bundle was read"


# ----------------------------------------------------------------------------- the tokenizer

def hf_texts(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "texts.csv"
    path.write_text(f"text\n{text}\n")
    return path


@pytest.mark.parametrize("content,phrase", [
    ('{"version": "1.0", "model": ', "EOF while parsing"),
    ("[1, 2, 3]", "cannot be loaded"),
    ('{"version": "1.0", "truncation": null}', "cannot be loaded"),
])
def test_a_malformed_tokenizer_is_exit_4_naming_the_file(hf_bundle, tmp_path, content, phrase):
    model = copy_bundle(hf_bundle, tmp_path / "b")
    put_tokenizer(model, content)
    run = predict(model, hf_texts(tmp_path, "rain and wind"), tmp_path)
    assert_clean_failure(run, 4, "model.tokenizer.json cannot be loaded", phrase)


# Regular expressions that backtrack catastrophically on the text beside them: the regex engine
# (Oniguruma) stops at its retry limit, and the tokenizers library panics (pyo3's
# PanicException, a BaseException) after printing Rust's report and backtrace on stderr.
CATASTROPHIC = [
    ("pre_tokenizer", {"type": "Split", "pattern": {"Regex": "(x+x+)+y"},
                       "behavior": "Isolated", "invert": False}, "x" * 40),
    ("normalizer", {"type": "Replace", "pattern": {"Regex": "(a|aa)+$"}, "content": ""},
     "a" * 60 + "b"),
]


@pytest.mark.parametrize("part,spec,text", CATASTROPHIC, ids=["split", "replace"])
def test_a_tokenizer_regex_that_panics_the_rust_library_is_exit_4(hf_bundle, tmp_path, part,
                                                                  spec, text):
    model = copy_bundle(hf_bundle, tmp_path / "b")
    tokenizer = json.loads(model.with_suffix(".tokenizer.json").read_text())
    tokenizer[part] = spec
    put_tokenizer(model, json.dumps(tokenizer))
    run = predict(model, hf_texts(tmp_path, text), tmp_path)
    assert_clean_failure(run, 4, "model.tokenizer.json failed on the texts",
                         "the tokenizers library panicked", "retry-limit")
    assert "panicked at" not in run.stderr and "stack backtrace" not in run.stderr
    assert not (tmp_path / "preds.csv").exists()


# ----------------------------------------------------------------------------- the schema


def test_the_schema_knows_the_networks_and_archs_models_builds():
    """manifest_schema names models.py's networks and torchvision archs without importing torch
    (inference reads it): the lists must stay the same."""
    from ttc.serving import manifest_schema
    from ttc.nets import models
    from ttc.tasks.registry import TASKS

    assert set(manifest_schema.NETWORKS) == {name for task in TASKS
                                             for name in models.network_modules(task.kind)}
    kind_of_form = {"words": "text", manifest_schema.HF_TOKENIZER: "text"}
    for task in TASKS:  # each type builds the networks the schema checks against its records
        assert set(task.part("modules")) == {
            name for name, form in manifest_schema.NETWORK_FORMS.items()
            if kind_of_form.get(form, form) == task.kind}
    assert set(manifest_schema.TORCHVISION_ARCHS) == set(models.TORCHVISION_ARCHS)
    from ttc.nets.hf import GRAPH_INPUTS

    assert manifest_schema.HF_GRAPH_INPUTS == GRAPH_INPUTS


def test_the_session_bundles_pass_the_schema(digits_bundle, text_bundle):
    from ttc.serving.manifest_schema import agreement_problem, manifest_problem

    for bundle in (digits_bundle, text_bundle):
        manifest = json.loads(bundle["model"].with_suffix(".json").read_text())
        assert manifest_problem(manifest) is None and agreement_problem(manifest) is None
