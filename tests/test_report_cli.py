"""The pictures a run leaves: the plots and the HTML page that pipeline.py and inference.py write
beside the report, and `report.py`, which rebuilds them from a saved JSON."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from PIL import Image

from conftest import assert_clean_failure, run_cli

ALL_PLOTS = {"training_curves", "confusion_matrix", "reliability", "calibration_shift",
             "ttt_shifts", "benchmark", "tta"}


def assert_pngs(plots: dict, folder: Path) -> None:
    for name, path in plots.items():
        assert Path(path) == folder / f"{name}.png"
        with Image.open(path) as image:
            assert image.format == "PNG" and min(image.size) >= 200
            assert len(image.convert("RGB").getcolors(1 << 20) or ()) > 1


def test_a_full_run_draws_every_plot_and_the_page_beside_its_report(wine_bundle):
    # wine_bundle ran TTA, TTT under two shifts, fp16 (so a benchmark table), an ensemble
    report, folder = wine_bundle["report"], wine_bundle["dir"]
    assert set(report["plots"]) == ALL_PLOTS
    assert_pngs(report["plots"], folder / "plots")
    page = Path(report["html"])
    assert page == folder / "report.html"
    text = page.read_text(encoding="utf-8")
    assert text.count("<img") == len(ALL_PLOTS) and 'src="data:image/png;base64,' in text
    assert f"plots: {len(ALL_PLOTS)} PNG in {folder / 'plots'}" in wine_bundle["run"].stdout
    assert f"page: {page}" in wine_bundle["run"].stdout


def test_without_a_report_file_the_plots_go_beside_the_model(digits_bundle):
    report, folder = digits_bundle["report"], digits_bundle["dir"]
    # no TTA, TTT, iterative or benchmark in this run: only what its data allows
    assert set(report["plots"]) == {"training_curves", "confusion_matrix", "reliability"}
    assert_pngs(report["plots"], folder / "plots")
    # no report file: the page beside the model too (issue #64 item 5)
    assert report["html"] == str(folder / "report.html") and (folder / "report.html").is_file()


def test_report_py_rebuilds_plots_and_page_from_a_saved_json(wine_bundle, tmp_path):
    saved = tmp_path / "cron.json"
    shutil.copy(wine_bundle["dir"] / "report.json", saved)
    before = saved.read_bytes()
    run = run_cli("report.py", saved)
    assert run.returncode == 0, run.stderr[-2000:]
    assert saved.read_bytes() == before  # the saved report is read, never changed
    assert (tmp_path / "cron.html").is_file()
    assert {p.stem for p in (tmp_path / "cron_plots").iterdir()} == ALL_PLOTS
    assert f"page: {tmp_path / 'cron.html'}" in run.stdout
    # an old report without the evaluation and the history: what its data allows, no error
    old = json.loads(before)
    old.pop("evaluation")
    old.pop("calibration", None)
    old["train"].pop("history")
    for row in (old.get("iterative") or {}).get("rows", []):
        row.pop("reliability", None)
    (tmp_path / "old.json").write_text(json.dumps(old))
    run = run_cli("report.py", tmp_path / "old.json", "--plots", tmp_path / "old")
    assert run.returncode == 0, run.stderr[-2000:]
    assert {p.stem for p in (tmp_path / "old").iterdir()} == {"ttt_shifts", "benchmark", "tta"}


def test_report_py_bad_inputs_fail_with_one_line(tmp_path):
    assert_clean_failure(run_cli("report.py", tmp_path / "missing.json"), 3, "does not exist")
    (tmp_path / "broken.json").write_text('{"version": 1, "status"')
    assert_clean_failure(run_cli("report.py", tmp_path / "broken.json"), 3, "is not JSON")
    (tmp_path / "other.json").write_text('{"name": "not a report"}')
    assert_clean_failure(run_cli("report.py", tmp_path / "other.json"), 3, "not a run's report")
    report = tmp_path / "report.json"
    report.write_text('{"version": 1, "status": "ok"}')
    assert_clean_failure(run_cli("report.py", report, "--html", report), 2,
                         "is the same file as REPORT.json")
    assert_clean_failure(run_cli("report.py", report, "--plots", "none", "--html", "none"), 2,
                         "nothing to write")
    run = run_cli("report.py", report, "--plots", "none")  # a report with no section: a page
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "report.html").is_file() and not (tmp_path / "plots").exists()


def test_a_plots_or_page_path_that_is_a_file_or_an_input_is_refused_before_any_work(tmp_path):
    (tmp_path / "taken").write_text("x")
    run = run_cli("pipeline.py", "--dataset_path", "builtin:iris", "--model_type",
                  "tabular_classifier", "--output_model", tmp_path / "model.onnx", "--plots",
                  tmp_path / "taken")
    assert_clean_failure(run, 2, "--plots", "it is a file")
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "tta.png").write_text("text,label\nhello,a\n")
    run = run_cli("inference.py", "--model", tmp_path / "model.onnx", "--input",
                  tmp_path / "plots" / "tta.png", "--output", tmp_path / "preds.csv",
                  "--report_json", tmp_path / "report.json")
    assert_clean_failure(run, 2, "--plots (tta.png)", "is the same file as --input")
    (tmp_path / "data.html").write_text("a,b,label\n1,2,x\n")
    run = run_cli("pipeline.py", "--dataset_path", tmp_path / "data.html", "--model_type",
                  "tabular_classifier", "--output_model", tmp_path / "model.onnx",
                  "--report_json", tmp_path / "data.json")
    assert_clean_failure(run, 2, "report page", "is the same file as --dataset_path")
    assert not (tmp_path / "model.onnx").exists()
