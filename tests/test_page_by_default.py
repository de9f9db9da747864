"""Issue #64 item 5: a pipeline run writes its page (and plots) beside the bundle whether or not
--report_json is given, and its summary ends with a `next:` block of the commands that use the
bundle, runnable as printed; the default page is one of the outputs checked before any work."""
from __future__ import annotations

import csv
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from config import build_parser, parse_config
from conftest import CLI_ENV, REPO, assert_clean_failure, run_cli

# The stdout line count of README's main job (the command below) at commit 1945808, before the
# page by default and the `next:` block: `pipeline.py ... | wc -l` gave 70, 3 of them the test
# split's confusions (one line per confused pair: as many as the run's errors make).
README_SUMMARY_LINES = 70 - 3
CONFUSION_ROW = re.compile(r"^    \S+ → \S+: \d+$")


def config_of(script: str, *argv: str):
    return parse_config(build_parser(script, "test"), list(argv))


def next_block(stdout: str) -> list[str]:
    """The commands of the summary's closing `next:` block (the label on the first one's line,
    the others aligned under it)."""
    lines = stdout.rstrip("\n").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("next: "))
    assert all(line.startswith("      python ") for line in lines[start + 1:]), lines[start:]
    return [line[6:] for line in lines[start:]]


@pytest.fixture(scope="module")
def iris_run(tmp_path_factory) -> dict:
    """A tiny pipeline run without --report_json."""
    out = tmp_path_factory.mktemp("iris")
    model = out / "model.onnx"
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:iris", "--epochs", "2", "--no_progress", "true",
                  "--output_model", model)
    assert run.returncode == 0, run.stderr[-3000:]
    return {"dir": out, "model": model, "run": run}


def test_without_a_report_file_the_page_and_plots_are_beside_the_bundle(iris_run):
    folder, stdout = iris_run["dir"], iris_run["run"].stdout
    page = folder / "report.html"
    assert page.is_file() and "<html" in page.read_text(encoding="utf-8")
    assert sorted(p.name for p in (folder / "plots").iterdir()) == [
        "confusion_matrix.png", "reliability.png", "training_curves.png"]
    assert f"page: {page} (plots: 3 PNG in {folder / 'plots'})" in stdout
    assert stdout.startswith("status: ok (total seconds: ")
    assert "plots and page written" in iris_run["run"].stderr


def test_the_next_commands_run_as_printed(iris_run, tmp_path):
    model = iris_run["model"]
    commands = next_block(iris_run["run"].stdout)
    assert commands == [
        f"python inference.py --model {model} --input FILE --output predictions.csv",
        f"python serve.py --model {model}"]
    rows = tmp_path / "flowers.csv"
    with rows.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["sepal length (cm)", "sepal width (cm)", "petal length (cm)",
                         "petal width (cm)"])
        writer.writerows([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]])
    # as printed, FILE replaced by the CSV, in a folder of its own (--output is relative)
    argv = [rows if arg == "FILE" else arg for arg in shlex.split(commands[0])]
    assert argv[:2] == ["python", "inference.py"]
    done = subprocess.run([sys.executable, REPO / "inference.py", *argv[2:]], cwd=tmp_path,
                          env={**os.environ, **CLI_ENV}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len((tmp_path / "predictions.csv").read_text().splitlines()) == 3  # header + 2 rows


def test_a_default_page_over_an_input_is_refused_before_any_work(tmp_path):
    data = tmp_path / "report.html"  # the page model.onnx would get, here an input
    data.write_text("a,b,label\n" + "".join(f"{i},{i % 3},{'xy'[i % 2]}\n" for i in range(40)))
    before = data.read_bytes()
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path", data,
                  "--epochs", "1", "--output_model", tmp_path / "model.onnx")
    assert_clean_failure(run, 2, "--output_model (the report page beside it)",
                         "is the same file as --dataset_path")
    assert data.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]  # nothing written


@pytest.mark.parametrize("script,argv,page", [
    ("pipeline", ["--output_model", "r/model.onnx"], "r/report.html"),
    ("pipeline", ["--output_model", "r/digits.onnx"], "r/digits_report.html"),
    ("pipeline", ["--output_model", "r/model.onnx", "--report_json", "-"], "r/report.html"),
    ("pipeline", ["--output_model", "r/model.onnx", "--plots", "p"], "r/report.html"),
    # with a report file the page stays beside it, as before (--plots none too)
    ("pipeline", ["--output_model", "r/model.onnx", "--report_json", "o/run.json"], "o/run.html"),
    ("pipeline", ["--output_model", "r/model.onnx", "--report_json", "o/run.json", "--plots",
                  "none"], "o/run.html"),
    # --plots none without a report file: no pictures and no page, as before
    ("pipeline", ["--output_model", "r/model.onnx", "--plots", "none"], None),
    # inference.py reads the bundle: it never writes beside it unless asked
    ("inference", ["--output_model", "r/model.onnx"], None),
    ("inference", ["--output_model", "r/model.onnx", "--report_json", "o/i.json"], "o/i.html"),
])
def test_where_the_page_goes(script, argv, page):
    found = config_of(script, *argv).page_path()
    assert found == (Path(page) if page else None)


def test_train_and_export_name_their_next_step(tmp_path):
    from ttc.reporting.run import next_commands

    model = str(tmp_path / "my runs" / "model.onnx")
    quoted = shlex.quote(model)
    assert next_commands("train", model) == [f"python export.py --output_model {quoted}"]
    assert next_commands("export", model)[1] == f"python serve.py --model {quoted}"
    assert next_commands("inference", model) == next_commands("quantize", model) == []


def test_the_readme_main_job_prints_no_more_lines_than_before(tmp_path):
    run = run_cli("pipeline.py", "--model_type", "image_classifier", "--dataset_path",
                  "builtin:digits", "--output_model", tmp_path / "model.onnx", "--report_json",
                  tmp_path / "report.json")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if not CONFUSION_ROW.match(line)]
    assert len(lines) <= README_SUMMARY_LINES, run.stdout
    assert next_block(run.stdout)[1] == f"python serve.py --model {tmp_path / 'model.onnx'}"
    assert (tmp_path / "report.html").is_file()
