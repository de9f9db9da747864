"""Hugging Face transformers for text (--arch hf:NAME_OR_PATH): a tiny BERT and WordPiece
tokenizer built by the test (no download), fine-tuned through train → export → int8 → inference,
served by inference.py with the Rust tokenizer and neither torch nor transformers."""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from conftest import assert_clean_failure, heavy_modules_after, run_cli, topic_texts

TEXTS = [t for t, _ in topic_texts()]
HF_TRAINING = ["--learning_rate", "3e-3", "--batch_size", "16", "--no_progress", "true"]


def write_texts_csv(path: Path) -> Path:
    lines = ["text,label"] + [f'"{t}",{label}' for t, label in topic_texts()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def graph_feed(tokenizer_json: Path, texts: list[str], extra_padding: int = 0) -> dict:
    """What a user's own deployment would feed model.onnx: the bundle's tokenizer.json loaded by
    the tokenizers library, padded, with the attention mask from the encodings."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    encodings = tokenizer.encode_batch(texts)
    ids = np.array([e.ids for e in encodings], dtype=np.int64)
    mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
    pad = tokenizer.padding["pad_id"]
    ids = np.pad(ids, ((0, 0), (0, extra_padding)), constant_values=pad)
    mask = np.pad(mask, ((0, 0), (0, extra_padding)))
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def test_hf_bundle_trains_exports_quantizes_and_serves(hf_bundle):
    report, folder = hf_bundle["report"], hf_bundle["dir"]
    assert report["status"] == "ok"
    assert report["train"]["arch"].startswith("hf:") and report["train"]["network"] == "HFTextNet"
    assert report["inference"]["accuracy"] >= 0.9, report["inference"]
    export = report["export"]
    assert export["max_abs_diff"] <= 1e-4 and export["top1_agreement"] == 1.0
    assert set(export["probes"]) == {"held_out", "length_1", "padded"}
    assert export["padding_max_diff"] <= 1e-5
    assert report["quantize"]["mode"] == "dynamic"
    # ONNX Runtime's transformer fusion: one Attention node per layer (the tiny BERT has 2),
    # checked against PyTorch like any export; dynamic int8 turns them into QAttention
    assert export["fusion"]["fused"]["Attention"] == 2, export["fusion"]
    ops = {graph_file: [n.op_type for n in onnx.load(str(folder / graph_file)).graph.node]
           for graph_file in ("model.onnx", "model.int8.onnx")}
    assert ops["model.onnx"].count("Attention") == 2
    assert ops["model.int8.onnx"].count("QAttention") == 2
    # ONNX Runtime's shape inference gives up on this graph and would leave its temporary files
    # in the working directory (the repository, for these runs)
    assert not list(Path(__file__).resolve().parent.parent.glob("sym_shape_infer_temp*.onnx"))
    manifest = json.loads((folder / "model.json").read_text())
    assert manifest["input"]["name"] == "input_ids"
    assert [i["name"] for i in manifest["input"]["extra_inputs"]] == ["attention_mask",
                                                                       "token_type_ids"]
    # the tokenizer is a bundle file, hashed like every other
    tokenizer_file = folder / manifest["files"]["tokenizer"]
    assert tokenizer_file.name == "model.tokenizer.json"
    import hashlib
    assert hashlib.sha256(tokenizer_file.read_bytes()).hexdigest() == \
        manifest["files"]["sha256"]["tokenizer"] == manifest["preprocessing"]["sha256"]
    for graph_file in ("model.onnx", "model.int8.onnx"):
        model = onnx.load(str(folder / graph_file))
        assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask",
                                                       "token_type_ids"]
        dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
        assert all(isinstance(d, str) and d for d in dims), dims  # dynamic batch and length
        assert any(n.op_type == "MatMulInteger" or n.op_type == "DynamicQuantizeMatMul"
                   or "Integer" in n.op_type for n in model.graph.node) == (graph_file != "model.onnx")


def test_a_user_deployment_with_tokenizer_json_matches_inference_py(hf_bundle, tmp_path):
    """model.onnx fed by tokenizers + onnxruntime alone gives inference.py's predictions, and
    extra padding (attention mask 0) changes no probability."""
    folder = hf_bundle["dir"]
    texts = TEXTS[:40]
    (tmp_path / "in.csv").write_text("text\n" + "\n".join(texts) + "\n", encoding="utf-8")
    run = run_cli("inference.py", "--output_model", folder / "model.onnx", "--input",
                  tmp_path / "in.csv", "--output", tmp_path / "preds.csv")
    assert run.returncode == 0, run.stderr[-2000:]
    with open(tmp_path / "preds.csv", newline="") as f:
        served = [row for row in csv.DictReader(f)]
    # inference.py runs fp32 unless --quantized true (dynamic int8 quantizes activations by each
    # batch's range, so its probabilities move with the batch's other rows and its padding)
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    labels = json.loads((folder / "model.json").read_text())["labels"]
    tokenizer_json = folder / "model.tokenizer.json"
    probabilities = session.run(["probabilities"], graph_feed(tokenizer_json, texts))[0]
    padded = session.run(["probabilities"], graph_feed(tokenizer_json, texts, 9))[0]
    np.testing.assert_allclose(padded, probabilities, atol=1e-5)
    assert [labels[i] for i in probabilities.argmax(1)] == [r["label"] for r in served]
    np.testing.assert_allclose([float(r["confidence"]) for r in served],
                               probabilities.max(1), atol=1e-5)


def test_inference_serves_hf_bundles_without_torch_or_transformers(hf_bundle, tmp_path):
    (tmp_path / "in.csv").write_text("text\nSunny and windy today\nBake the garlic\n")
    imported = heavy_modules_after("inference.py", "--output_model", hf_bundle["model"],
                                   "--input", tmp_path / "in.csv", "--output",
                                   tmp_path / "preds.csv",
                                   modules=("torch", "transformers", "dspy", "tokenizers"))
    assert imported == ["tokenizers"]
    rows = list(csv.DictReader(open(tmp_path / "preds.csv", newline="")))
    assert [r["label"] for r in rows] == ["weather", "food"]


def test_special_token_text_is_read_as_text(hf_bundle):
    """"[PAD]" or "[SEP]" written in a text are words, never the padding or separator ids (the
    attention mask is built from the padding id)."""
    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.inputs.preprocess import text_tokenizer

    manifest = read_manifest(BundlePaths.from_model_path(hf_bundle["model"]))
    pre = manifest.preprocessing.spec
    ids = text_tokenizer(pre).encode_batch(["rain [PAD] [SEP] snow", "fog"])
    first = ids[0][ids[0] != pre["pad_id"]]
    assert len(first) == len(ids[0]) and list(first[1:-1]).count(pre["pad_id"]) == 0
    added = [i for i in first if i in pre["special_ids"] and i != pre["unk_id"]]
    assert added == [first[0], first[-1]]  # [CLS] and the final [SEP] only
    assert (ids[1] == pre["pad_id"]).sum() > 0  # the shorter text is padded


def test_stage_clis_rebuild_the_network_without_the_checkpoint(hf_model_dir, tmp_path):
    """train.py (default learning rate for hf: 2e-5), then export.py and quantize.py after the
    checkpoint folder is gone: the bundle alone (its config and tokenizer.json) rebuilds it."""
    source = shutil.copytree(hf_model_dir, tmp_path / "checkpoint")
    data = write_texts_csv(tmp_path / "texts.csv")
    model = tmp_path / "out" / "model.onnx"
    run = run_cli("train.py", "--model_type", "text_classifier", "--dataset_path", data,
                  "--arch", f"hf:{source}", "--epochs", "1", "--output_model", model,
                  "--report_json", tmp_path / "train.json", "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((tmp_path / "train.json").read_text())["config"]["learning_rate"] == 2e-5
    shutil.rmtree(source)
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    run = run_cli("export.py", "--output_model", model, "--dataset_path", data,
                  "--no_progress", "true", extra_env=offline)
    assert run.returncode == 0, run.stderr[-2000:]
    run = run_cli("quantize.py", "--output_model", model, "--dataset_path", data, "--quantize",
                  "dynamic", "--no_progress", "true", extra_env=offline)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "out" / "model.int8.onnx").is_file()


def test_a_tokenizer_whose_padding_id_is_not_0(hf_pad1_bundle):
    """RoBERTa-style: <pad> is id 1. The graph records it, and padding still changes nothing."""
    bundle, folder = hf_pad1_bundle, hf_pad1_bundle["dir"]
    assert bundle["report"]["export"]["padding_max_diff"] <= 1e-5
    model = onnx.load(str(bundle["model"]))
    assert {p.key: p.value for p in model.metadata_props}["padding_id"] == "1"
    feed = graph_feed(folder / "model.tokenizer.json", TEXTS[:20])
    assert (feed["input_ids"] == 1).any()  # padded with 1
    session = ort.InferenceSession(str(bundle["model"]), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(
        session.run(["probabilities"], graph_feed(folder / "model.tokenizer.json", TEXTS[:20],
                                                  5))[0],
        session.run(["probabilities"], feed)[0], atol=1e-5)
    assert bundle["report"]["inference"]["accuracy"] >= 0.6


def test_a_hub_name_not_in_the_cache_is_exit_3(tmp_path):
    data = write_texts_csv(tmp_path / "texts.csv")
    run = run_cli("pipeline.py", "--model_type", "text_classifier", "--dataset_path", data,
                  "--arch", "hf:distilbert-base-uncased", "--output_model",
                  tmp_path / "model.onnx", extra_env={"HF_HUB_OFFLINE": "1",
                                                      "HF_HOME": str(tmp_path / "hf_home")})
    assert_clean_failure(run, 3, "hf:distilbert-base-uncased", "not in the Hugging Face cache",
                         str(tmp_path / "hf_home"), "HF_HUB_OFFLINE")
    assert not (tmp_path / "model.onnx").exists()


@pytest.mark.parametrize("args,phrase", [
    (["--model_type", "image_classifier", "--dataset_path", "builtin:digits",
      "--arch", "hf:bert-base-uncased"], "--model_type text_classifier"),
    (["--model_type", "text_classifier", "--arch", "hf:"], "give a hub name"),
    (["--model_type", "text_classifier", "--arch", "hf:x", "--ttt", "true",
      "--ttt_method", "bn"], "--ttt_method tent"),
])
def test_hf_arch_flag_errors_are_exit_2(tmp_path, args, phrase):
    if "--dataset_path" not in args:
        args = [*args, "--dataset_path", str(write_texts_csv(tmp_path / "texts.csv"))]
    run = run_cli("pipeline.py", *args, "--output_model", tmp_path / "model.onnx")
    assert_clean_failure(run, 2, phrase)


def test_a_folder_that_is_not_a_checkpoint_is_exit_3(tmp_path):
    (tmp_path / "empty").mkdir()
    run = run_cli("pipeline.py", "--model_type", "text_classifier", "--dataset_path",
                  write_texts_csv(tmp_path / "texts.csv"), "--arch", f"hf:{tmp_path / 'empty'}",
                  "--output_model", tmp_path / "model.onnx")
    assert_clean_failure(run, 3, "save_pretrained")


def test_an_edited_tokenizer_file_is_refused(hf_bundle, tmp_path):
    folder = shutil.copytree(hf_bundle["dir"], tmp_path / "bundle")
    path = folder / "model.tokenizer.json"
    path.write_text(path.read_text().replace('"[UNK]"', '"[UNKNOWN]"', 1))
    (tmp_path / "in.csv").write_text("text\nrain\n")
    run = run_cli("inference.py", "--output_model", folder / "model.onnx", "--input",
                  tmp_path / "in.csv", "--output", tmp_path / "preds.csv")
    assert_clean_failure(run, 4, "tokenizer", "sha256")


def test_candidate_search_and_the_lm_teacher_take_hf_archs(hf_model_dir, tmp_path):
    """DSPy's side works unchanged: two learning rates searched, and a teacher's labels added
    to the training split (the hf tokenizer is kept, not refitted like ours)."""
    from conftest import TOPICS
    from lm_server import FakeChatServer

    def label(text: str) -> str:
        words = set(text.lower().split())
        return next((topic for topic, vocab in TOPICS.items() if words & set(vocab)), "sports")

    unlabeled = tmp_path / "unlabeled.txt"
    unlabeled.write_text("\n".join(t for t, _ in topic_texts(10, seed=5)) + "\n")
    env = {"DSPY_CACHEDIR": str(tmp_path / "dspy_cache"), "OPENAI_API_KEY": "test"}
    with FakeChatServer(label) as server:
        run = run_cli("train.py", "--model_type", "text_classifier", "--dataset_path",
                      write_texts_csv(tmp_path / "texts.csv"), "--arch", f"hf:{hf_model_dir}",
                      "--epochs", "3", "--lr_candidates", "3e-3,1e-3", *HF_TRAINING[2:],
                      "--teacher_lm", "openai/teacher", "--teacher_api_base", server.api_base,
                      "--unlabeled_path", unlabeled, "--teacher_demos", "2",
                      "--output_model", tmp_path / "out" / "model.onnx",
                      "--report_json", tmp_path / "report.json", extra_env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [c["learning_rate"] for c in report["train"]["candidates"]] == [3e-3, 1e-3]
    assert report["teacher"]["labelled"] > 0
    assert report["train"]["samples"] == report["dataset"]["train"] + report["teacher"]["labelled"]
    manifest = json.loads((tmp_path / "out" / "model.json").read_text())
    assert manifest["preprocessing"]["tokenizer"] == "huggingface"
