"""A run's default log is quiet: the configuration summary lists only the settings not at their
defaults (every one at --log_level DEBUG and in the report's config), library chatter waits for
DEBUG, and test-time training measured on clean data only says how to see what it buys."""
from __future__ import annotations

import json

from conftest import run_cli

from config import flags_for

QUIET_TITLE = "not at their defaults; all of them at --log_level DEBUG and in the report's config"
HINT = "add --eval_shift feature_noise (or another corruption) to measure it under shift"


def settings_block(stderr: str) -> tuple[str, dict[str, tuple[bool, str]]]:
    """The configuration summary on stderr: its title line and {flag: (starred, value)}."""
    lines = stderr.split(" INFO    configuration ", 1)[1].splitlines()
    block = {}
    for line in lines[1:]:
        if not line.startswith("  ") or " = " not in line:
            break
        left, value = line.split(" = ", 1)
        block[left[3:].strip()] = (left[2] == "*", value)
    return lines[0], block


def iris_ttt(tmp_path, *flags: str):
    """Two epochs on builtin:iris with --ttt true; the run, its report and its stdout."""
    report = tmp_path / "report.json"
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:iris", "--epochs", "2", "--ttt", "true", "--output_model",
                  tmp_path / "bundle" / "model.onnx", "--report_json", report, "--no_progress",
                  "true", *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads(report.read_text())


def test_the_default_log_lists_only_changed_settings_and_ttt_names_eval_shift(tmp_path):
    run, report = iris_ttt(tmp_path)
    title, block = settings_block(run.stderr)
    starred = sum(1 for _, (changed, _) in block.items() if changed)
    assert QUIET_TITLE in title and title.startswith(f"({starred} ")
    assert starred == len(block) <= 10, block  # the flags given, and the type's learning rate
    assert block["epochs"] == (True, "2") and block["ttt"] == (True, "True")
    for untouched in ("seed", "batch_size", "opset", "eval_shift"):
        assert untouched not in block
    assert "[torch.onnx]" not in run.stderr
    assert list(report["config"]) == flags_for("pipeline")  # the report keeps every setting
    assert report["config"]["seed"] == 0 and report["config"]["epochs"] == 2
    assert report["ttt"]["verdict"].endswith(HINT)
    verdicts = [line for line in run.stdout.splitlines() if line.startswith("  verdict: bn:")]
    assert len(verdicts) == 1 and verdicts[0].endswith(HINT)


def test_debug_lists_every_setting_and_a_shift_run_has_no_hint(tmp_path):
    run, report = iris_ttt(tmp_path, "--log_level", "DEBUG", "--eval_shift", "feature_noise")
    title, block = settings_block(run.stderr)
    assert title == "(* = not the default):"
    assert list(block) == flags_for("pipeline")
    assert block["seed"] == (False, "0") and block["eval_shift"] == (True, "'feature_noise'")
    assert "shifted (mean of 1)" in report["ttt"]["verdict"]
    assert "--eval_shift" not in report["ttt"]["verdict"]
    assert "--eval_shift" not in run.stdout.split("\nttt:", 1)[1]


def test_the_hint_suits_the_model_type_s_corruptions():
    from ttc.testtime.ttt import with_clean_only_hint

    assert with_clean_only_hint("bn: clean +0.0 pt", "image").startswith(
        "bn: clean +0.0 pt; measured on clean data only")
    assert "--eval_shift contrast " in with_clean_only_hint("x", "segmentation")
    assert "--eval_shift contrast " in with_clean_only_hint("x", "detection")
    assert "--eval_shift unknown_tokens " in with_clean_only_hint("x", "text")
    assert with_clean_only_hint("x", "no such kind") == "x"
