"""Memory bounds on what a bundle or an input declares, checked before the memory is taken: one
huge line or text in an input, a manifest of 20,000 labels (and a real model of that many
classes, which must work), an image size the graph does not pin, network widths the weights
file cannot hold, and graphs whose tensors (ConstantOfShape, Expand, Tile, Resize, ... ) take
gigabytes. Each hostile bundle is a copy of a session bundle edited as an attacker would
(contract stamp and sha256 recomputed); each run's peak memory is measured as the only child
of a fresh process, under an address-space limit where torch is not imported."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import (REPO, Run, assert_clean_failure, copy_bundle, deflate_in_place, edit_manifest,
                      sha256)

FAST = ["--no_progress", "true", "--num_threads", "1"]
PEAK_MB = 1500  # generous: every refused case here stays under 500 MB, the unbounded ones took GBs
# A child that does not import torch runs under this address-space limit: a regression fails
# with a MemoryError instead of taking the machine (torch maps gigabytes of CUDA libraries).
ADDRESS_SPACE_MB = 4000

MEASURE = """
import resource, subprocess, sys
limit = int(sys.argv[1])
def cap():
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit << 20, limit << 20))
with open(sys.argv[2], "rb") as stdin:
    run = subprocess.run(sys.argv[3:], preexec_fn=cap, stdin=stdin, capture_output=True)
sys.stdout.buffer.write(run.stdout)
sys.stderr.buffer.write(run.stderr)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
sys.exit(run.returncode)
"""


def measured(script: str, *args: object, timeout: int = 120, stdin: Path | None = None,
             address_space_mb: int = ADDRESS_SPACE_MB) -> tuple[Run, float]:
    """Run a CLI as the only child of a fresh interpreter: its result and peak RSS in MB."""
    command = [sys.executable, "-c", MEASURE, str(address_space_mb), str(stdin or "/dev/null"),
               sys.executable, str(REPO / script), *map(str, args)]
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})
    stderr, _, peak = proc.stderr.rstrip("\n").rpartition("\n")
    return Run(proc.returncode, proc.stdout, stderr), int(peak) / 1024








def replace_graph(model: Path, variant: str, graph) -> None:
    """Write `graph` as the bundle's `variant` file, stamped with the manifest's contract and
    named by its sha256 in the manifest, as an attacker (or a real exporter) would."""
    from ttc.serving.bundle import stamp_contract

    manifest = json.loads(model.with_suffix(".json").read_text())
    path = model if variant == "onnx" else model.with_suffix(f".{variant}.onnx")
    path.write_bytes(stamp_contract(graph, manifest).SerializeToString())
    edit_manifest(model, lambda m: m["files"]["sha256"].update({variant: sha256(path)}))


def restamp_graphs(model: Path) -> None:
    """Every graph of the bundle stamped with its (edited) manifest's contract."""
    import onnx

    manifest = json.loads(model.with_suffix(".json").read_text())
    for variant in ("onnx", "bn", "mc"):
        if manifest["files"].get(variant):
            path = model if variant == "onnx" else model.with_suffix(f".{variant}.onnx")
            replace_graph(model, variant, onnx.load(str(path)))


# ----------------------------------------------------------------------------- text rows


def text_input(path: Path, long_text: str, fmt: str) -> Path:
    """A small input of the text bundle's topics with one long text in its second row."""
    texts = ["the match was a win for our team", long_text, "rain and wind with a storm"]
    if fmt == "csv":
        path.write_text("text\n" + "".join(f'"{t}"\n' for t in texts))
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    else:  # .txt: a headerless TSV of one column
        path.write_text("".join(t + "\n" for t in texts))
    return path


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "txt"])
def test_a_huge_line_in_a_text_input_is_refused_before_it_is_parsed(text_bundle, tmp_path, fmt):
    # 64 MB in one line: reading and tokenizing it took 40x its size (a 1 GB line: 12.6 GB)
    data = text_input(tmp_path / f"in.{fmt}", "goal rain " * 6_400_000, fmt)
    run, peak = measured("inference.py", "--model", text_bundle["model"], "--input", data,
                         "--output", tmp_path / "preds.csv", *FAST)
    line = 3 if fmt == "csv" else 2  # after the header
    assert_clean_failure(run, 3, f"{data} line {line} is longer than --max_row_bytes 1048576 "
                         "bytes", "raise --max_row_bytes")
    assert peak < PEAK_MB, peak
    assert not (tmp_path / "preds.csv").exists()


def test_a_huge_line_on_stdin_is_refused_without_being_read_whole(text_bundle, tmp_path):
    stdin = tmp_path / "stdin.txt"
    stdin.write_text("a short text\n" + "match " * 10_000_000 + "\nanother\n")
    run, peak = measured("inference.py", "--model", text_bundle["model"], "--input", "-",
                         "--output", tmp_path / "preds.csv", *FAST, stdin=stdin)
    assert_clean_failure(run, 3, "line 2 of the standard input is longer than --max_row_bytes")
    assert peak < PEAK_MB, peak


def test_a_huge_quoted_cell_over_many_lines_is_refused_before_tokenizing(text_bundle, tmp_path):
    # each line is short, so only the text's own length tells: 3 MB in 60,000 lines
    data = text_input(tmp_path / "in.csv", "snow fog\n" * 330_000, "csv")
    run = measured("inference.py", "--model", text_bundle["model"], "--input", data,
                   "--output", tmp_path / "preds.csv", *FAST)[0]
    assert_clean_failure(run, 3, "the text of row 2 has 2,969,999 characters, over "
                         "--max_row_bytes 1048576")


def test_max_row_bytes_lets_a_long_real_row_through(text_bundle, tmp_path):
    data = text_input(tmp_path / "in.csv", "sunny forecast " * 140_000, "csv")  # 2.1 MB
    run = measured("inference.py", "--model", text_bundle["model"], "--input", data,
                   "--output", tmp_path / "preds.csv", "--max_row_bytes", "4000000", *FAST)[0]
    assert run.returncode == 0, run.stderr[-2000:]
    assert len((tmp_path / "preds.csv").read_text().splitlines()) == 4


def test_training_data_with_a_huge_line_is_refused_before_training(tmp_path):
    data = text_input(tmp_path / "train.csv", "recipe " * 300_000, "csv")
    run = measured("train.py", "--model_type", "text_classifier", "--dataset_path", data,
                   "--output_model", tmp_path / "m" / "model.onnx", *FAST,
                   address_space_mb=0)[0]
    assert_clean_failure(run, 3, "line 3 is longer than --max_row_bytes")
    assert not list(tmp_path.glob("m/model.*"))


# ----------------------------------------------------------------------------- classes


def many_class_bundle(digits_bundle: dict, folder: Path, classes: int) -> Path:
    """A real digits model of `classes` classes: the ten digits and many more, a graph of one
    linear layer over the pixels (the digits' own weights, the others' random and lower), its
    manifest and stamp as export writes them."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = copy_bundle(digits_bundle, folder)
    labels = [str(d) for d in range(10)] + [f"class {k:05d}" for k in range(10, classes)]
    rng = np.random.default_rng(0)
    weights = rng.normal(0, 0.01, (64, classes)).astype(np.float32)
    from sklearn.datasets import load_digits

    digits = load_digits()
    means = np.stack([digits.data[digits.target == d].mean(0) / 16 for d in range(10)])
    weights[:, :10] = (means - means.mean(0)).T * 4
    bias = np.full(classes, -1.0, np.float32)
    bias[:10] = 0
    nodes = [helper.make_node("Flatten", ["image"], ["flat"]),
             helper.make_node("Gemm", ["flat", "w", "b"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1)]
    graph = helper.make_graph(
        nodes, "many_classes",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 1, 8, 8])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", classes])
         for name in ("logits", "probabilities")],
        [numpy_helper.from_array(weights, "w"), numpy_helper.from_array(bias, "b")])
    graph_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                                    ir_version=9)

    def change(manifest: dict) -> None:
        manifest["labels"] = labels
        manifest["architecture"]["num_classes"] = classes
        manifest["dataset"]["train_class_counts"] = [100] * 10 + [1] * (classes - 10)
        for output in manifest["outputs"]:
            output["shape"] = ["batch", classes]
        for key in ("bn", "mc"):
            manifest["files"].pop(key, None)
            manifest["files"]["sha256"].pop(key, None)
            manifest["extra_graphs"].pop(key, None)

    edit_manifest(model, change)
    replace_graph(model, "onnx", onnx.shape_inference.infer_shapes(graph_model))
    return model


def test_a_model_of_20000_classes_evaluates_without_a_dense_confusion_matrix(digits_bundle,
                                                                              tmp_path):
    # 20,000 classes: the confusion matrix alone was 400 million counts (9.4 GB peak)
    model = many_class_bundle(digits_bundle, tmp_path / "b", 20_000)
    report_path = tmp_path / "report.json"
    run, peak = measured("inference.py", "--model", model, "--report_json", report_path,
                         "--plots", "none", *FAST)
    assert run.returncode == 0, run.stderr[-2000:]
    assert peak < PEAK_MB, peak
    evaluation = json.loads(report_path.read_text())["evaluation"]
    assert evaluation["confusion_matrix"] is None
    assert len(evaluation["per_class"]) == 20_000 and evaluation["samples"] == 269
    assert evaluation["accuracy"] > 0.5  # the digits' own weights, against 19,990 others
    pairs = evaluation["confusion_pairs"]
    assert 0 < len(pairs) <= 1000 and pairs[:5] == evaluation["top_confusions"]
    assert sum(p["count"] for p in pairs) == round(269 * (1 - evaluation["accuracy"]))
    assert "most frequent confusions" in run.stdout and "20 lowest F1 of 20000" in run.stdout
    page = subprocess.run([sys.executable, "report.py", report_path, "--plots", "none"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert page.returncode == 0, page.stderr[-2000:]
    assert "no confusion matrix for 20000 classes" in report_path.with_suffix(".html").read_text()


def test_up_to_a_thousand_classes_keep_their_matrix(digits_bundle, tmp_path):
    model = many_class_bundle(digits_bundle, tmp_path / "b", 1000)
    report_path = tmp_path / "report.json"
    run = measured("inference.py", "--model", model, "--report_json", report_path, "--plots",
                   "none", *FAST)[0]
    assert run.returncode == 0, run.stderr[-2000:]
    evaluation = json.loads(report_path.read_text())["evaluation"]
    matrix = np.array(evaluation["confusion_matrix"])
    assert matrix.shape == (1000, 1000) and matrix.sum() == 269
    assert np.trace(matrix) == round(269 * evaluation["accuracy"])
    assert "confusion_pairs" not in evaluation


def test_a_manifest_of_more_labels_than_any_model_has_is_refused(digits_bundle, tmp_path):
    model = copy_bundle(digits_bundle, tmp_path / "b")
    edit_manifest(model, lambda m: m.update(labels=[f"c{k}" for k in range(150_000)]))
    run, peak = measured("inference.py", "--model", model, *FAST)
    assert_clean_failure(run, 4, "labels lists 150,000 classes; this tool takes at most 100,000")
    assert peak < PEAK_MB, peak


# ----------------------------------------------------------------------------- image size


def symbolic_image_bundle(digits_bundle: dict, folder: Path, size: list) -> Path:
    """The digits bundle with a graph that takes images of any height and width (the network
    pools globally) and a manifest that says `size`."""
    import onnx

    model = copy_bundle(digits_bundle, folder)

    def change(manifest: dict) -> None:
        manifest["preprocessing"]["image_size"] = size
        manifest["architecture"]["image_size"] = size
        manifest["input"]["shape"] = ["batch", 1, *size]
    edit_manifest(model, change)
    manifest = json.loads(model.with_suffix(".json").read_text())
    for variant in ("onnx", "bn", "mc"):
        path = model if variant == "onnx" else model.with_suffix(f".{variant}.onnx")
        graph = onnx.load(str(path))
        for dim, name in zip(graph.graph.input[0].type.tensor_type.shape.dim[2:], "hw"):
            dim.dim_param = name
        if manifest["files"].get(variant):
            replace_graph(model, variant, graph)
    return model


def test_an_image_size_the_graph_leaves_open_cannot_make_gigabytes(digits_bundle, tmp_path):
    # 2500 x 2500: the 269 test images decoded took 6.7 GB before the graph ran
    model = symbolic_image_bundle(digits_bundle, tmp_path / "b", [4000, 4000])
    run, peak = measured("inference.py", "--model", model, *FAST)
    assert_clean_failure(run, 4, "the bundle's image size 4000x4000", "64.0 MB per decoded "
                         "image", "269 images of the test split take 17.2 GB, over "
                         "--max_image_memory_mb 4096")
    assert peak < PEAK_MB, peak


def test_an_image_size_beyond_any_graph_is_a_bundle_error(digits_bundle, tmp_path):
    model = symbolic_image_bundle(digits_bundle, tmp_path / "b", [1_000_000_000, 8])
    run = measured("inference.py", "--model", model, *FAST)[0]
    assert_clean_failure(run, 4, "preprocessing.image_size[0] must be an integer from 1 to 4096")


def test_input_chunks_of_big_images_shrink_to_the_memory_limit(tmp_path):
    from ttc.inputs.limits import LIMITS, images_per_chunk

    pre = {"image_size": [2048, 2048], "channels": 3}  # 50 MB per decoded image
    assert images_per_chunk(pre, 4096) == LIMITS.max_image_memory_mb * 2**20 // (4 * 50331648)
    assert images_per_chunk(pre, 4096, unit=16) == 16  # whole test-time training batches
    assert images_per_chunk({"image_size": [8, 8], "channels": 1}, 4096) == 4096


# ----------------------------------------------------------------------------- network widths


def test_network_widths_the_weights_cannot_hold_are_refused_before_building(digits_bundle,
                                                                            tmp_path):
    # [7000, 7000] made export.py build 5.6 GB of convolutions for a 270 KB model.pt
    model = copy_bundle(digits_bundle, tmp_path / "b")
    edit_manifest(model, lambda m: m["architecture"].update(widths=[7000, 7000]))
    run, peak = measured("export.py", "--output_model", model, *FAST, address_space_mb=0)
    assert_clean_failure(run, 4, "the manifest's architecture (SmallCNN) holds 5.3 GB of "
                         "tensors, and its weights file model.pt only")
    assert peak < PEAK_MB, peak


def test_weights_compressed_to_inflate_are_refused_before_torch_reads_them(digits_bundle,
                                                                           tmp_path):
    # torch.load inflates a compressed entry whole: 200 KB held a 200 MB tensor
    model = copy_bundle(digits_bundle, tmp_path / "b")
    weights = model.with_suffix(".pt")
    deflate_in_place(weights)
    edit_manifest(model, lambda m: m["files"]["sha256"].update(weights=sha256(weights)))
    run = measured("export.py", "--output_model", model, *FAST, address_space_mb=0)[0]
    assert_clean_failure(run, 4, "cannot load weights", "entries are compressed, inflating to",
                         "torch.save writes none compressed")


def declaring(path: Path, size: int) -> Path:
    """The torch file with its largest entry's sizes in the ZIP's central directory set to
    `size` (stored, as torch.save writes it, but claiming more than the file holds)."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        name = max(archive.infolist(), key=lambda info: info.file_size).filename.encode()
        record = archive.start_dir  # the central directory's first record
    data = bytearray(path.read_bytes())
    while data[record + 46:record + 46 + struct.unpack_from("<H", data, record + 28)[0]] != name:
        record = data.index(b"PK\x01\x02", record + 4)
    struct.pack_into("<II", data, record + 20, size, size)
    path.write_bytes(bytes(data))
    return path


def test_torch_files_declaring_more_than_they_hold_are_refused_before_torch_reads_them(
        digits_bundle, tmp_path):
    # the same check guards every torch file: a bundle's weights (exit 4) and --init_weights (3)
    model = copy_bundle(digits_bundle, tmp_path / "b")
    declaring(model.with_suffix(".pt"), 3_000_000_000)
    edit_manifest(model, lambda m: m["files"]["sha256"].update(
        weights=sha256(model.with_suffix(".pt"))))
    run = measured("export.py", "--output_model", model, *FAST, address_space_mb=0)[0]
    assert_clean_failure(run, 4, "cannot load weights", "entries declare 3.0 GB, more than the",
                         "the file holds")
    run = measured("train.py", "--dataset_path", "builtin:digits", "--epochs", "1", *FAST,
                   "--init_weights", model.with_suffix(".pt"), "--output_model",
                   tmp_path / "t" / "model.onnx", address_space_mb=0)[0]
    assert_clean_failure(run, 3, "cannot read weights", "entries declare 3.0 GB")


# ----------------------------------------------------------------------------- graphs


def with_bomb(digits_bundle: dict, folder: Path, variant: str, op: str) -> Path:
    """The digits bundle whose `variant` graph adds 0 × (the sum of a tensor of about 5 GB) to
    its logits: a tensor of fixed size, made by `op`."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = copy_bundle(digits_bundle, folder)
    path = model if variant == "onnx" else model.with_suffix(f".{variant}.onnx")
    graph = onnx.load(str(path))
    producer = next(n for n in graph.graph.node if "logits" in n.output)
    producer.output[list(producer.output).index("logits")] = "logits_before"
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    constants = {"shape": np.array([1_250_000_000], np.int64),
                 "repeats": np.array([1_250_000_000], np.int64),
                 "small": np.ones(1, np.float32), "zero": np.zeros(1, np.float32),
                 "scales": np.array([1, 1, 5000, 5000], np.float32)}
    bomb = {"ConstantOfShape": [helper.make_node("ConstantOfShape", ["shape"], ["big"],
                                                 value=one)],
            "Expand": [helper.make_node("Expand", ["small", "shape"], ["big"])],
            "Tile": [helper.make_node("Tile", ["small", "repeats"], ["big"])],
            "Resize": [helper.make_node("Resize", ["image", "", "scales"], ["big"])]}[op]
    bomb += [helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0),
             helper.make_node("Mul", ["total", "zero"], ["nothing"]),
             helper.make_node("Add", ["logits_before", "nothing"], ["logits"])]
    graph.graph.node.extend(bomb)
    graph.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in constants.items())
    replace_graph(model, variant, graph)
    return model


@pytest.mark.parametrize("variant, op, args", [
    ("onnx", "ConstantOfShape", []), ("onnx", "Expand", []), ("onnx", "Tile", []),
    ("onnx", "Resize", []), ("bn", "ConstantOfShape", ["--ttt", "true", "--ttt_method", "bn"]),
    ("mc", "Expand", ["--iterative", "mc_dropout", "--iterations", "2"])])
def test_a_graph_tensor_of_gigabytes_is_refused_before_a_session(digits_bundle, tmp_path,
                                                                 variant, op, args):
    # a ConstantOfShape of 5 GB ran to exit 0 with a peak of its size
    model = with_bomb(digits_bundle, tmp_path / "b", variant, op)
    run, peak = measured("inference.py", "--model", model, *args, *FAST)
    name = model.name if variant == "onnx" else f"model.{variant}.onnx"
    assert_clean_failure(run, 4, f"{name} refused: its tensor 'big' made by a", f"{op} node",
                         "per sample, over --max_runtime_memory_mb 4096")
    assert peak < PEAK_MB, peak


def test_a_graph_that_sizes_a_tensor_from_its_input_meets_the_runtime_limit(digits_bundle,
                                                                              tmp_path):
    """No check before running can size ConstantOfShape(batch x 100,000,000): ONNX Runtime's
    arena, capped by --max_runtime_memory_mb, refuses the allocation."""
    import onnx
    from onnx import helper, numpy_helper

    model = copy_bundle(digits_bundle, tmp_path / "b")
    graph = onnx.load(str(model))
    producer = next(n for n in graph.graph.node if "logits" in n.output)
    producer.output[list(producer.output).index("logits")] = "logits_before"
    graph.graph.node.extend([
        helper.make_node("Shape", ["image"], ["dims"], start=0, end=1),
        helper.make_node("Mul", ["dims", "per_row"], ["shape"]),
        helper.make_node("ConstantOfShape", ["shape"], ["big"]),
        helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0),
        helper.make_node("Mul", ["total", "zero"], ["nothing"]),
        helper.make_node("Add", ["logits_before", "nothing"], ["logits"])])
    graph.graph.initializer.extend([numpy_helper.from_array(np.array([100_000_000]), "per_row"),
                                    numpy_helper.from_array(np.zeros(1, np.float32), "zero")])
    replace_graph(model, "onnx", graph)
    run, peak = measured("inference.py", "--model", model, "--max_runtime_memory_mb", "256",
                         *FAST)
    assert_clean_failure(run, 5, "ONNX Runtime needed more memory than --max_runtime_memory_mb "
                         "256 allows", "ConstantOfShape node")
    assert peak < PEAK_MB, peak
