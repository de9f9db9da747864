"""Flags, help, and every bad input: exit code, one clear line, no traceback."""
from __future__ import annotations

import pytest

from conftest import REPO, assert_clean_failure, run_cli, write_image_folder

SCRIPTS = ["pipeline.py", "train.py", "export.py", "quantize.py", "inference.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_runs_and_shows_an_example(script):
    run = run_cli(script, "--help")
    assert run.returncode == 0 and "example" in run.stdout and "--log_level" in run.stdout


def test_pipeline_help_lists_every_flag_in_groups():
    text = run_cli("pipeline.py", "--help").stdout
    for group in ("data:", "training:", "export and validation:", "quantization:",
                  "test-time compute:", "runtime:", "output:"):
        assert group in text
    for flag in ("--model_type", "--dataset_path", "--output_model", "--tta", "--tta_transforms",
                 "--ttt", "--ttt_iterations", "--quantize", "--ep", "--batch_size",
                 "--learning_rate", "--epochs", "--log_level", "--seed", "--report_json",
                 "--val_fraction", "--test_fraction", "--num_threads", "--opset",
                 "--validate_atol", "--no_progress"):
        assert flag in text
    assert "exit codes" in text


BASE = ["--dataset_path", "builtin:digits", "--output_model", "OUT/m.onnx"]

CONFIG_ERRORS = [
    (["--epochs", "0"], "--epochs"),
    (["--epochs", "-3"], "--epochs"),
    (["--batch_size", "0"], "--batch_size"),
    (["--learning_rate", "0"], "--learning_rate"),
    (["--learning_rate", "-1e-3"], "--learning_rate"),
    (["--epochs", "ten"], "--epochs"),
    (["--tta", "maybe"], "--tta"),
    (["--no_progress", "2"], "--no_progress"),
    (["--ttt", "maybe"], "--ttt"),
    (["--calibration_size", "0"], "--calibration_size"),
    (["--max_accuracy_drop", "2"], "--max_accuracy_drop"),
    (["--strict_ep", "maybe"], "--strict_ep"),
    (["--ep", "cuda", "--ep_options", "cuda.foo=1"], "unknown option 'foo'"),
    (["--ep", "cuda", "--ep_options", '{"cuda": '], "not valid JSON"),
    (["--ep_options", "tensorrt.trt_fp16_enable=true"], "does not request"),
    (["--ep", "cuda", "--ep_options", "cuda.cudnn_conv_algo_search=FAST"], "EXHAUSTIVE"),
    (["--ep_options", "novalue"], "not key=value"),
    (["--execution_mode", "fast"], "--execution_mode"),
    (["--intra_op_threads", "-2"], "--intra_op_threads"),
    (["--quantize", "int4"], "--quantize"),
    (["--model_type", "text_classifier"], "use --model_type image_classifier"),
    (["--model_type", "video"], "--model_type"),
    (["--ep", "gpu"], "unknown execution provider"),
    (["--log_level", "LOUD"], "--log_level"),
    (["--val_fraction", "0"], "--val_fraction"),
    (["--test_fraction", "1.5"], "--test_fraction"),
    (["--val_fraction", "0.5", "--test_fraction", "0.5"], "too little to train"),
    (["--opset", "3"], "--opset"),
    (["--validate_atol", "0"], "--validate_atol"),
    (["--image_size", "0"], "--image_size"),
    (["--channels", "2"], "--channels"),
    (["--num_threads", "-1"], "--num_threads"),
]


@pytest.mark.parametrize("args,phrase", CONFIG_ERRORS)
def test_bad_flag_values_exit_2(tmp_path, args, phrase):
    base = [a.replace("OUT", str(tmp_path)) for a in BASE]
    run = run_cli("pipeline.py", *base, *args)
    assert_clean_failure(run, 2, phrase)
    assert not (tmp_path / "m.onnx").exists()


def test_bad_paths_exit_2(tmp_path):
    run = run_cli("pipeline.py", "--dataset_path", "builtin:mnist", "--output_model",
                  tmp_path / "m.onnx")
    assert_clean_failure(run, 2, "builtin:digits")
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--output_model",
                  tmp_path / "m.pt")
    assert_clean_failure(run, 2, ".onnx")
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits")
    assert_clean_failure(run, 2, "--output_model")


def test_cuda_request_falls_back_to_cpu_and_is_reported(digits_bundle, tmp_path):
    import json

    run = run_cli("inference.py", "--model", digits_bundle["model"], "--ep", "cuda,cpu",
                  "--report_json", tmp_path / "r.json")
    assert run.returncode == 0, run.stderr[-2000:]
    inference = json.loads((tmp_path / "r.json").read_text())["inference"]
    assert inference["providers_requested"] == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    active = inference["providers_active"]
    if "CUDAExecutionProvider" not in active:  # no GPU here: say so, don't pretend
        assert active == ["CPUExecutionProvider"] and "CUDAExecutionProvider" in run.stderr


def data_error(tmp_path, dataset, *phrases, extra=()):
    run = run_cli("pipeline.py", "--dataset_path", dataset, "--output_model",
                  tmp_path / "out" / "m.onnx", "--epochs", "1", *extra)
    assert_clean_failure(run, 3, *phrases)
    assert not (tmp_path / "out" / "m.onnx").exists()


def test_missing_dataset_path_exits_3(tmp_path):
    data_error(tmp_path, tmp_path / "nowhere", "does not exist")


def test_folder_without_images_exits_3(tmp_path):
    (tmp_path / "empty" / "cats").mkdir(parents=True)
    (tmp_path / "empty" / "cats" / "readme.txt").write_text("no images")
    data_error(tmp_path, tmp_path / "empty", "no images found")


def test_single_class_exits_3(tmp_path):
    root = write_image_folder(tmp_path / "one", classes=(7,), per_class=10)
    data_error(tmp_path, root, "1 class", "at least 2")


def test_only_corrupt_images_exits_3(tmp_path):
    for label in ("a", "b"):
        (tmp_path / "bad" / label).mkdir(parents=True)
        for i in range(3):
            (tmp_path / "bad" / label / f"{i}.png").write_bytes(b"garbage" * i)
    data_error(tmp_path, tmp_path / "bad", "could be read")


def test_table_with_a_missing_column_exits_3(tmp_path):
    table = tmp_path / "t.csv"
    table.write_text("file,digit\na.png,1\nb.png,2\n")
    data_error(tmp_path, table, "no column 'label'", "['file', 'digit']",
               extra=["--label_column", "label"])


def test_unsupported_file_type_exits_3(tmp_path):
    (tmp_path / "data.xlsx").write_bytes(b"PK")
    data_error(tmp_path, tmp_path / "data.xlsx", "expected a folder")


def test_empty_table_exits_3(tmp_path):
    (tmp_path / "t.csv").write_text("")
    data_error(tmp_path, tmp_path / "t.csv", "t.csv")


def test_class_missing_from_the_training_split_exits_3(tmp_path):
    root = write_image_folder(tmp_path / "data", splits=True)
    extra = root / "test" / "9"
    extra.mkdir()
    (root / "test" / "0" / next(iter(sorted(p.name for p in (root / "test" / "0").iterdir())))
     ).rename(extra / "moved.png")
    data_error(tmp_path, root, "training split lacks", "['9']")


def test_cli_reference_matches_the_flags():
    from config import markdown_reference

    reference = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    assert markdown_reference() in reference, "regenerate docs/cli.md's tables: see its top"
