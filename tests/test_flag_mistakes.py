"""Flags as a new user types them, run as subprocesses: the dashed spelling works everywhere, no
abbreviation is taken, and a flag the script does not have is exit 2 with one line naming the
flags probably meant (docs/cli.md#spelling-a-flag)."""
from __future__ import annotations

import json

import pytest

from conftest import REPO, assert_clean_failure, run_cli

SCRIPTS = ("pipeline.py", "train.py", "export.py", "quantize.py", "inference.py", "serve.py",
           "report.py")


def test_dashed_flags_are_the_flags(tmp_path):
    """--dataset-path, --output-model, --no-progress and --epochs=0 all parsed: the run gets as
    far as --epochs' own check (before: '--dataset_path is required')."""
    run = run_cli("pipeline.py", "--dataset-path", "builtin:digits", "--output-model",
                  tmp_path / "model.onnx", "--no-progress", "--epochs=0")
    assert_clean_failure(run, 2, "invalid --epochs 0")


def test_dashed_flags_reach_the_run_and_its_report(digits_bundle, tmp_path):
    report = tmp_path / "report.json"
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--batch-size", "32",
                  "--report-json", report, "--log-level=WARNING", "--no-progress")
    assert run.returncode == 0, run.stderr[-2000:]
    config = json.loads(report.read_text())["config"]
    assert config["batch_size"] == 32 and config["log_level"] == "WARNING"
    assert config["no_progress"] is True


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_takes_dashes_and_names_the_flag_meant(script):
    dashed = run_cli(script, "--log-level", "WARNING")  # accepted: what fails is the missing input
    assert_clean_failure(dashed, 2, "the following arguments are required")
    assert "log" not in dashed.error_lines()[0]
    typo = run_cli(script, "--log_levle", "DEBUG")
    assert_clean_failure(typo, 2, "unknown flag --log_levle", "did you mean --log_level")


def test_no_abbreviation_is_taken():
    """argparse would read --epoch 3 as --epochs 3 (and change its mind the day another flag
    starting with --epoch is added)."""
    for script in ("pipeline.py", "train.py"):
        run = run_cli(script, "--dataset_path", "builtin:digits", "--output_model",
                      "runs/never/model.onnx", "--epoch", "3")
        assert_clean_failure(run, 2, "unknown flag --epoch", "--epochs")
    assert not (REPO / "runs" / "never").exists()


def test_other_tools_names_point_to_ours():
    lr = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--lr", "0.01")
    assert_clean_failure(lr, 2, "unknown flag --lr", "did you mean --learning_rate")
    assert "ambiguous" not in lr.stderr
    data = run_cli("train.py", "--data", "photos")  # before the missing --output_model
    assert_clean_failure(data, 2, "unknown flag --data", "did you mean --dataset_path")
    batch = run_cli("serve.py", "--model", "m.onnx", "--bs", "8")
    assert_clean_failure(batch, 2, "unknown flag --bs", "did you mean --max_batch_size")
    out = run_cli("inference.py", "--model", "m.onnx", "--out", "preds.csv")
    assert_clean_failure(out, 2, "unknown flag --out", "did you mean --output")
    model = run_cli("export.py", "--model", "m.onnx")  # only inference.py and serve.py take it
    assert_clean_failure(model, 2, "unknown flag --model", "did you mean --output_model")


def test_a_misspelt_flag_gets_the_closest_one():
    run = run_cli("pipeline.py", "--modle_type", "text_classifier", "--dataset_path", "x.csv")
    assert_clean_failure(run, 2, "unknown flag --modle_type", "did you mean --model_type")
    nothing_close = run_cli("quantize.py", "--zzzz", "1")
    assert_clean_failure(nothing_close, 2, "unknown flag --zzzz; see quantize.py --help")


def test_numbers_and_values_are_not_taken_for_flags():
    """-1 is a value (the flag's own check answers), as is what follows a bare --."""
    negative = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--output_model",
                       "runs/never/model.onnx", "--learning_rate", "-1")
    assert_clean_failure(negative, 2, "invalid --learning_rate -1")
    after = run_cli("report.py", "--", "--not-a-flag.json")
    assert after.returncode == 3 and "unknown flag" not in after.stderr, after.stderr[-2000:]


def test_help_lists_one_spelling():
    run = run_cli("pipeline.py", "--help")
    assert run.returncode == 0
    assert "--dataset_path" in run.stdout and "--dataset-path" not in run.stdout
    assert "object detector" in run.stdout and "semantic segmenter" in run.stdout


def test_docs_list_the_common_names():
    from ttc.options.spelling import COMMON_NAMES

    page = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    assert "## Spelling a flag" in page
    for typed, meant in COMMON_NAMES.items():
        assert f"`{typed}`" in page and all(f"`{flag}`" in page for flag in meant), typed
