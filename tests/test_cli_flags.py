"""What a user sees of the flags: booleans bare or with a value, a configuration summary and a
report config section holding only the running script's flags (non-defaults marked), and one
warning per run for an execution-provider fallback."""
from __future__ import annotations

import json

from conftest import run_cli


def config_block(stderr: str) -> dict[str, tuple[bool, str]]:
    """The configuration summary on stderr: {flag: (marked as not the default, value)}."""
    lines = stderr.split("configuration (* = not the default):\n", 1)[1].splitlines()
    block = {}
    for line in lines:
        if not line.startswith("  ") or " = " not in line:
            break
        left, value = line.split(" = ", 1)
        block[left[3:].strip()] = (left[2] == "*", value)
    return block


def test_boolean_flags_work_bare_and_with_a_value(digits_bundle):
    bare = run_cli("inference.py", "--model", digits_bundle["model"], "--json", "--no_progress")
    assert bare.returncode == 0, bare.stderr[-2000:]
    report = json.loads(bare.stdout)  # stdout is the JSON report and nothing else
    assert report["config"]["json"] is True and report["config"]["no_progress"] is True
    valued = run_cli("inference.py", "--model", digits_bundle["model"], "--json", "false",
                     "--no_progress", "true")
    assert valued.returncode == 0, valued.stderr[-2000:]
    assert valued.stdout.startswith("status: ok")
    wrong = run_cli("inference.py", "--model", digits_bundle["model"], "--tta", "maybe")
    assert wrong.returncode == 2 and "expected true or false" in wrong.stderr


def test_summary_and_report_list_only_the_scripts_flags(digits_bundle, tmp_path):
    from config import flags_for

    report_path = tmp_path / "report.json"
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--batch_size", "32",
                  "--report_json", report_path, "--no_progress", "true", "--log_level", "DEBUG")
    assert run.returncode == 0, run.stderr[-2000:]
    block = config_block(run.stderr)
    assert list(block) == flags_for("inference")
    for training_only in ("epochs", "teacher_lm", "learning_rate", "opset"):
        assert training_only not in block
    assert block["batch_size"] == (True, "32") and block["seed"] == (False, "0")
    assert block["no_progress"][0] and not block["tta"][0]
    assert list(json.loads(report_path.read_text())["config"]) == flags_for("inference")


def test_every_flag_belongs_to_a_script_and_pipeline_takes_the_training_flags():
    from dataclasses import fields

    from config import SCRIPTS, Config, flags_for

    for field in fields(Config):
        assert set(field.metadata["scripts"]) <= set(SCRIPTS.values()) and \
            field.metadata["scripts"], field.name
    assert set(flags_for("train")) <= set(flags_for("pipeline"))
    assert {"input", "output", "model_type", "epochs"} & set(flags_for("export")) == set()


def test_a_provider_fallback_is_warned_once_per_run(digits_bundle):
    """Inference, TTA's graph and the benchmark each make a session on the asked providers."""
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--ep", "cuda", "--tta",
                  "--benchmark", "--no_progress")
    assert run.returncode == 0, run.stderr[-2000:]
    if "CUDAExecutionProvider" in run.stdout.split("providers", 1)[1].splitlines()[0]:
        return  # a machine whose CUDA works has nothing to warn about
    fallbacks = [line for line in run.stderr.splitlines() if "provider fallback" in line]
    assert len(fallbacks) == 1, fallbacks
