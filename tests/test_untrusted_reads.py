"""What a bundle or a report makes the tool read and write (issue 37): a path a manifest records
is never read, messages quote a few short values at most, plots never go through a symbolic
link the tool did not get from the user, and reports of every kind of run draw (or fail with
one line)."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from conftest import assert_clean_failure, run_cli

SECRETS = ["hunter2-SECRET", "letmein-SECRET"]
NOT_READ = "does not read a path a bundle names on its own"


def bundle_copy(bundle: dict, dest: Path) -> Path:
    """The bundle's own files (no report, plots or data) in `dest`: its model.onnx."""
    shutil.copytree(bundle["dir"], dest,
                    ignore=shutil.ignore_patterns("report*", "plots", "*.csv", "*.tsv"))
    return dest / "model.onnx"


def edit_dataset(model: Path, **recorded: object) -> None:
    """What an attacker writes into the manifest's `dataset` (no hash covers it)."""
    path = model.with_suffix(".json")
    manifest = json.loads(path.read_text())
    manifest["dataset"].update(recorded)
    path.write_text(json.dumps(manifest))


def decoy(path: Path) -> Path:
    """A file beside the bundle holding secrets, its access time set to 0: a read moves it."""
    path.write_text("host\tpassword\n" + "".join(f"h{i}\t{s}\n" for i, s in enumerate(SECRETS)))
    os.utime(path, (0, os.stat(path).st_mtime))
    return path


def atime_moves_on_read(folder: Path) -> bool:
    """Whether this mount updates a file's access time when it is read (relatime does for an
    access time older than the modification time); where not, only that assertion is skipped."""
    control = folder / "control.txt"
    control.write_text("x")
    os.utime(control, (0, os.stat(control).st_mtime))
    control.read_text()
    return os.stat(control).st_atime != 0


def assert_unread(path: Path, tracks: bool) -> None:
    if tracks:
        assert os.stat(path).st_atime == 0, f"{path} was opened"


# ----------------------------------------------------------------------------- recorded paths


@pytest.mark.parametrize("script", ["inference.py", "quantize.py", "export.py"])
def test_a_data_path_a_manifest_records_is_never_read(text_bundle, tmp_path, script):
    """Any recorded path, not only a planted one: each stage script refuses with exit 2 before
    reading anything, quoting the path (not the file), and the decoy is never opened."""
    tracks = atime_moves_on_read(tmp_path)
    model = bundle_copy(text_bundle, tmp_path / "b")
    secret = decoy(tmp_path / "secret.tsv")
    edit_dataset(model, path=str(secret), has_header="true", label_column="password",
                 text_column="host")
    flag = "--model" if script == "inference.py" else "--output_model"
    extra = ["--quantize", "dynamic"] if script == "quantize.py" else []
    run = run_cli(script, flag, model, *extra, "--no_progress", "true", timeout=120)
    assert_clean_failure(run, 2, "the bundle records that it was trained on", str(secret)[:60],
                         NOT_READ, "pass --dataset_path PATH")
    assert "SECRET" not in run.stdout + run.stderr
    assert_unread(secret, tracks)
    assert not model.parent.joinpath("model.int8.onnx").exists()


def test_recorded_split_files_are_named_again_and_options_still_apply(text_bundle, tmp_path):
    """A recorded --test_path is not read either (even with --dataset_path given): the user
    names it again. The recorded reading options apply to the data the user names: here the
    attacker's label column, which the user's file does not have (exit 3 naming it)."""
    tracks = atime_moves_on_read(tmp_path)
    model = bundle_copy(text_bundle, tmp_path / "b")
    secret = decoy(tmp_path / "secret.tsv")
    edit_dataset(model, test_path=str(secret))
    data = text_bundle["dir"] / "texts.csv"
    run = run_cli("inference.py", "--model", model, "--dataset_path", data, timeout=120)
    assert_clean_failure(run, 2, "separate test file", str(secret)[:60], NOT_READ,
                         "--test_path PATH")
    assert_unread(secret, tracks)
    edit_dataset(model, test_path=None, label_column="password")
    run = run_cli("inference.py", "--model", model, "--dataset_path", data, timeout=120)
    assert_clean_failure(run, 3, "no column 'password'")
    assert_unread(secret, tracks)


def test_a_long_recorded_path_is_quoted_short_and_escaped(text_bundle, tmp_path):
    model = bundle_copy(text_bundle, tmp_path / "b")
    edit_dataset(model, path="/data/\x1b[31m" + "x" * 5000 + ".tsv")
    run = run_cli("inference.py", "--model", model, timeout=120)
    assert_clean_failure(run, 2, NOT_READ, "--input PATH")
    line = run.error_lines()[0]
    assert "\x1b" not in line and "\\x1b[31m" in line and len(line) < 400


# ----------------------------------------------------------------------------- messages


def test_unknown_labels_are_quoted_few_and_short(text_bundle, tmp_path):
    """The user's own file this time, with 40 unknown labels: 3 quoted, cut to 20 characters,
    and how many more, instead of the file's content."""
    rows = [f'"some text {i}",SECRET-{i:02d}-{"z" * 60}' for i in range(40)]
    data = tmp_path / "other.csv"
    data.write_text("text,label\n" + "\n".join(rows) + "\n")
    run = run_cli("inference.py", "--model", text_bundle["model"], "--dataset_path", data,
                  timeout=120)
    assert_clean_failure(run, 3, "labels the model was not trained on",
                         "['SECRET-00-zzzzzzzzzz'…", "and 37 more")
    assert run.stderr.count("SECRET") == 3 and "z" * 30 not in run.stderr


def test_a_files_columns_are_listed_few_and_short(text_bundle, tmp_path):
    model = bundle_copy(text_bundle, tmp_path / "b")
    edit_dataset(model, label_column="body")  # recorded: applied to the data the user names
    data = tmp_path / "wide.csv"
    names = [f"column_{i:03d}_{'w' * 40}" for i in range(300)]
    data.write_text(",".join(names) + "\n" + ",".join(["1"] * 300) + "\n")
    run = run_cli("inference.py", "--model", model, "--dataset_path", data, timeout=120)
    assert_clean_failure(run, 3, "no column 'body'", "and 290 more")
    assert "column_010" not in run.stderr and len(run.error_lines()[0]) < 600


# ----------------------------------------------------------------------------- plots folder


def linked_folder(link: Path, target: Path) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target, target_is_directory=True)
    return target


def test_report_py_never_writes_through_a_linked_plots_folder(digits_bundle, tmp_path):
    report = tmp_path / "r.json"
    report.write_text(json.dumps(digits_bundle["report"]))
    elsewhere = linked_folder(tmp_path / "r_plots", tmp_path / "elsewhere")
    run = run_cli("report.py", report, timeout=120)
    assert_clean_failure(run, 2, "r_plots is a symbolic link", "--plots DIR")
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "r.html").exists()
    named = linked_folder(tmp_path / "mine", tmp_path / "chosen")  # named by the user: used
    run = run_cli("report.py", report, "--plots", tmp_path / "mine", timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (named / "confusion_matrix.png").is_file() and list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("script", ["inference.py", "pipeline.py"])
def test_a_run_refuses_a_linked_plots_folder_before_any_work(digits_bundle, tmp_path, script):
    elsewhere = linked_folder(tmp_path / "out" / "plots", tmp_path / "elsewhere")
    if script == "inference.py":
        args = ["--model", digits_bundle["model"], "--report_json",
                tmp_path / "out" / "report.json"]
    else:  # beside the model: refused before the data is read or anything trained
        args = ["--dataset_path", "builtin:digits", "--output_model",
                tmp_path / "out" / "model.onnx", "--epochs", "1"]
    started = time.monotonic()
    run = run_cli(script, *args, timeout=120)
    assert_clean_failure(run, 2, "plots is a symbolic link")
    assert list(elsewhere.iterdir()) == [] and time.monotonic() - started < 30
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["plots"]


# ----------------------------------------------------------------------------- reports


def test_the_report_of_a_ttt_run_without_eval_shift_draws(digits_bundle, tmp_path):
    """The run writes its page (no empty WARNING), and report.py draws it again (it was
    StopIteration, exit 5): the test-time training plot of the clean split alone."""
    report = tmp_path / "r.json"
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--ttt", "true",
                  "--num_threads", "1", "--no_progress", "true", "--report_json", report,
                  timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "WARNING" not in run.stderr, run.stderr[-2000:]
    assert (tmp_path / "r.html").is_file()
    (tmp_path / "r.html").unlink()
    run = run_cli("report.py", report, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "r.html").is_file() and (tmp_path / "r_plots" / "ttt_shifts.png").is_file()


@pytest.mark.parametrize("text", [
    '{"version": 1, "status": "ok", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"a": ' + '{"b": ' * 50_000 + "1" + "}" * 50_001,
    "[" * 100_000,  # not even closed
])
def test_a_report_nested_far_too_deep_is_exit_3(tmp_path, text):
    report = tmp_path / "r.json"
    report.write_text(text)
    run = run_cli("report.py", report, timeout=120)
    assert_clean_failure(run, 3, "nested deeper than 32 levels")
    assert not (tmp_path / "r.html").exists()


def test_a_report_far_larger_than_any_run_writes_is_not_read(tmp_path):
    report = tmp_path / "r.json"
    with open(report, "wb") as handle:
        handle.truncate(70_000_000)  # sparse: no disk, and no byte of it may be read
    run = run_cli("report.py", report, timeout=60)
    assert_clean_failure(run, 3, "70,000,000 bytes, over the 64 MiB", "it was not read")


def test_the_depth_is_counted_in_linear_time_outside_strings():
    from ttc.reporting.run import nesting_depth, text_nesting_depth

    for value in ({}, [[]], {"a": "[[[{"}, {"a": '\\"[['}, {"a": [{"b": [1, "]]"]}]}):
        assert text_nesting_depth(json.dumps(value)) == nesting_depth(value)
    started = time.monotonic()  # an unclosed string, then escaped quotes: no quadratic rescans
    assert text_nesting_depth('["' + '\\"' * 1_000_000) == 1
    assert time.monotonic() - started < 5
