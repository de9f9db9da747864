"""Hardening, round 3: relative bundle paths through quantization, outputs that would need
another output to be a folder, places no file can be created in, weight-file messages that never
advise turning safety off, error lines a terminal cannot misread, reports nested without end,
an --ensemble that names nothing, and profile figures that add up."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import REPO, assert_clean_failure, run_cli, write_image_folder

ONE_EPOCH = ["--epochs", "1", "--no_progress", "true"]


def run_in(cwd: Path, script: str, *args: object):
    """A CLI run from `cwd`, so that relative paths are relative to it, as a user types them."""
    return run_cli(script, *map(str, args), cwd=cwd)


# ----------------------------------------------------------------------------- class 1


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_quantize_py_works_on_a_relative_bundle_path(digits_bundle, tmp_path, mode):
    """quant_pre_process ran in a temporary folder and resolved the relative path from there."""
    shutil.copytree(digits_bundle["dir"], tmp_path / "runs" / "d")
    done = run_in(tmp_path, "quantize.py", "--output_model", "runs/d/model.onnx", "--quantize",
                  mode, "--calibration_size", "64", "--report_json", "runs/d/q.json")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "runs" / "d" / "q.json").read_text())
    assert report["quantize"]["mode"] == mode
    assert (tmp_path / "runs" / "d" / "model.int8.onnx").is_file()
    assert not list((tmp_path / "runs" / "d").glob("tmp*"))  # the scratch folder is gone


# ----------------------------------------------------------------------------- class 10


@pytest.mark.parametrize("plots", ["out/r.html", "out/r.json", "out/r.profile.json"])
def test_plots_that_would_need_the_report_page_or_trace_to_be_a_folder_exit_2_first(
        digits_bundle, tmp_path, plots):
    done = run_in(tmp_path, "inference.py", "--model", digits_bundle["model"], "--report_json",
                  "out/r.json", "--plots", plots, "--profile", "true")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    line = [x for x in done.stderr.splitlines() if "error:" in x]
    assert len(line) == 1 and "would need" in line[0] and plots in line[0], done.stderr
    assert not (tmp_path / "out").exists()  # nothing written, not even a stray temporary


def test_pipeline_refuses_plots_over_the_report_before_training(tmp_path):
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:iris", *ONE_EPOCH, "--output_model", tmp_path / "m" / "model.onnx",
                  "--report_json", tmp_path / "o" / "report.json", "--plots",
                  tmp_path / "o" / "report.html")
    assert_clean_failure(run, 2, "would need the report page")
    assert not (tmp_path / "m").exists() and not (tmp_path / "o").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="as another user os.access already refuses")
@pytest.mark.parametrize("where", ["/sys/kernel/report.json", "/proc/report.json"])
def test_a_place_where_no_file_can_be_created_is_refused_before_work_even_as_root(tmp_path,
                                                                                   where):
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:iris", *ONE_EPOCH, "--output_model", tmp_path / "model.onnx",
                  "--report_json", where)
    assert_clean_failure(run, 2, f"--report_json {where} cannot be written")
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- class 11


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("weights") / "img", classes=(0, 1),
                              per_class=12)


@pytest.mark.parametrize("content", [os.urandom(2048), b"\x80\x02}q\x00(X\x01\x00\x00\x00a",
                                     b"PK\x03\x04 not a zip"])
def test_an_unreadable_weight_file_never_gets_torch_s_advice_to_turn_safety_off(
        images, tmp_path, content):
    weights = tmp_path / "start.pt"
    weights.write_bytes(content)
    run = run_cli("train.py", "--dataset_path", images, *ONE_EPOCH, "--init_weights", weights,
                  "--output_model", tmp_path / "b" / "model.onnx")
    assert_clean_failure(run, 3, f"cannot read weights {weights}")
    assert "weights_only" not in run.stderr and "False" not in run.error_lines()[0]
    assert not (tmp_path / "b").exists()


def test_a_damaged_torch_hub_cache_file_says_so_and_not_to_pass_a_safetensors_file(images,
                                                                                  tmp_path):
    cached = tmp_path / "home" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(os.urandom(4096))
    run = run_cli("pipeline.py", "--dataset_path", images, "--arch", "resnet18", "--pretrained",
                  "true", *ONE_EPOCH, "--output_model", tmp_path / "b" / "model.onnx",
                  extra_env={"TORCH_HOME": str(tmp_path / "home")})
    assert_clean_failure(run, 3, "torch hub cache's copy is damaged", str(cached))
    assert ".safetensors" not in run.error_lines()[0] and "weights_only" not in run.stderr


def test_control_characters_in_an_error_line_are_shown_escaped(tmp_path):
    """A file name holding a terminal escape sequence and a line break: the error stays one
    line, and the terminal receives no escape character."""
    name = tmp_path / "bad\x1b[2J\x1b[31mname\nsecond.csv"
    name.write_text("a,b\n1,2\n")
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path", name,
                  *ONE_EPOCH, "--output_model", tmp_path / "b" / "model.onnx")
    assert run.returncode == 3, run.stderr[-2000:]
    assert "\x1b" not in run.stderr
    assert len(run.error_lines()) == 1 and "\\x1b[2J" in run.error_lines()[0]
    assert "\\nsecond.csv" in run.error_lines()[0]


def test_an_error_line_quoting_a_huge_value_is_cut_keeping_its_start_and_hint(tmp_path):
    """A 2,500-character path in the message (any value may be that long): the line is cut to
    2,000 characters around its middle, the error's start and its hint kept."""
    folder = tmp_path.joinpath(*["d" * 250] * 10)
    folder.mkdir(parents=True)
    (folder / "t.csv").write_text("a,b\n1,2\n")
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  folder / "t.csv", *ONE_EPOCH, "--output_model", tmp_path / "b" / "model.onnx")
    assert_clean_failure(run, 3, "characters cut)…", "a classifier needs at least 2")
    line = run.error_lines()[0]
    assert line.startswith(f"pipeline.py: error: {tmp_path}")
    assert len(line) <= 2000 + len("pipeline.py: error: ")


# ----------------------------------------------------------------------------- class 12


@pytest.mark.parametrize("nested", ['{"a":' * 5000 + "1" + "}" * 5000,
                                    "[" * 300 + "]" * 300])
def test_report_py_refuses_a_report_nested_without_end_as_a_data_error(tmp_path, nested):
    report = tmp_path / "report.json"
    report.write_text('{"version": 1, "status": "ok", "x": ' + nested + "}")
    run = run_cli("report.py", report)
    assert_clean_failure(run, 3, "nested deeper than")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_report_py_still_draws_a_real_report(digits_bundle, tmp_path):
    report = tmp_path / "report.json"
    report.write_text(json.dumps(digits_bundle["report"]))
    run = run_cli("report.py", report, "--plots", "none")
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "report.html").is_file()


@pytest.mark.parametrize("members", [",", " , ,", ""])
def test_an_ensemble_that_names_no_bundle_is_a_usage_error(digits_bundle, members):
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--iterative", "ensemble",
                  "--ensemble", members)
    assert_clean_failure(run, 2, "--ensemble")
