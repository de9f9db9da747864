"""Batch inference (`inference.py --input ... --output ...`): folders, tables and stdin, error
rows, accuracy when labels are given, and outputs that are whole or absent."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, assert_clean_failure, heavy_modules_after, run_cli, write_image_folder


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_image_folder_with_a_corrupt_image(digits_bundle, tmp_path):
    folder = write_image_folder(tmp_path / "new", classes=(3, 7), per_class=6)
    (folder / "3" / "broken.png").write_bytes(b"not a png at all")
    preds, errors = tmp_path / "out" / "preds.csv", tmp_path / "out" / "errors.csv"
    args = ["--model", digits_bundle["model"], "--input", folder, "--output", preds,
            "--errors", errors, "--top_k", "3"]
    run = run_cli("inference.py", *args)
    assert_clean_failure(run, 3, "1 of 13 rows could not be predicted", str(errors))
    rows = read_csv(preds)  # the good rows are written all the same
    assert len(rows) == 12 and {r["true_label"] for r in rows} == {"3", "7"}
    assert list(rows[0])[:7] == ["id", "label", "confidence", "top2_label", "top2_probability",
                                 "top3_label", "top3_probability"]  # the top class once
    assert sum(r["label"] == r["true_label"] for r in rows) >= 9
    failed = read_csv(errors)
    assert len(failed) == 1 and failed[0]["id"].endswith("broken.png")
    assert "unreadable image" in failed[0]["reason"]
    run = run_cli("inference.py", *args, "--allow_errors", "true", "--json", "true")
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout)["predictions"]
    assert summary["rows"] == 13 and summary["predicted"] == 12 and summary["failed"] == 1
    assert summary["labeled"] == 12 and 0.75 <= summary["accuracy"] <= 1


def test_csv_with_labels_a_bad_row_and_jsonl_output(tabular_bundle, tmp_path):
    new = tmp_path / "new.csv"
    new.write_text("kind,weight,height,color\n"  # other column order than training
                   "a,5.1,0.2,red\nb,0.1,2.9,blue\nc,-4.2,-3.1,green\n"
                   "a,lots,0.1,red\n"  # a non-numeric weight: an error row
                   "=cmd,5.0,,red\n")  # an unknown label, echoed safely; a missing height
    preds = tmp_path / "preds.jsonl"
    run = run_cli("inference.py", "--model", tabular_bundle["model"], "--input", new,
                  "--output", preds, "--errors", tmp_path / "errors.csv", "--allow_errors",
                  "true", "--report_json", tmp_path / "report.json")
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in preds.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["1", "2", "3", "5"]
    assert [r["label"] for r in rows[:3]] == ["a", "b", "c"]
    assert rows[3]["true_label"] == "=cmd"  # JSON is data, not a spreadsheet
    failed = read_csv(tmp_path / "errors.csv")
    assert failed == [{"id": "4", "reason": "non-numeric value 'lots' in column 'weight'"}]
    summary = json.loads((tmp_path / "report.json").read_text())["predictions"]
    assert summary["labeled"] == 4 and summary["accuracy"] == 0.75  # "=cmd" is never right
    csv_out = tmp_path / "preds.csv"
    run = run_cli("inference.py", "--model", tabular_bundle["model"], "--input", new,
                  "--output", csv_out, "--allow_errors", "true", "--quiet", "true")
    assert run.returncode == 0 and run.stdout == "" and run.stderr == ""
    assert read_csv(csv_out)[3]["true_label"] == "'=cmd"  # neutralised for spreadsheets


def test_missing_feature_column_and_bad_output_suffix_fail_clearly(tabular_bundle, tmp_path):
    new = tmp_path / "new.csv"
    new.write_text("height,color\n1.0,red\n")
    run = run_cli("inference.py", "--model", tabular_bundle["model"], "--input", new,
                  "--output", tmp_path / "p.csv")
    assert_clean_failure(run, 3, "lacks the feature columns ['weight']")
    assert not (tmp_path / "p.csv").exists()
    run = run_cli("inference.py", "--model", tabular_bundle["model"], "--input", new,
                  "--output", tmp_path / "p.xlsx")
    assert_clean_failure(run, 2, "--output", ".csv, .jsonl or .parquet")
    run = run_cli("inference.py", "--model", tabular_bundle["model"], "--input",
                  tmp_path / "nowhere.csv", "--output", tmp_path / "p.csv")
    assert_clean_failure(run, 3, "does not exist")


def test_texts_on_stdin_with_mc_dropout_uncertainty(text_bundle, tmp_path):
    texts = ["the team scored a goal in the match", "bake the garlic in the oven", "",
             "storm and rain"]
    preds = tmp_path / "preds.csv"
    run = subprocess.run(
        [sys.executable, str(REPO / "inference.py"), "--model", str(text_bundle["model"]),
         "--input", "-", "--output", str(preds), "--iterative", "mc_dropout", "--iterations",
         "8"], input="\n".join(texts) + "\n", capture_output=True, text=True, cwd=REPO,
        timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = read_csv(preds)
    assert [r["id"] for r in rows] == ["1", "2", "3", "4"]
    assert [rows[i]["label"] for i in (0, 1, 3)] == ["sports", "food", "weather"]
    assert all(float(r["entropy"]) >= 0 and float(r["std"]) >= 0 for r in rows)
    assert "rows predicted" in run.stdout


def test_output_is_whole_or_absent_when_killed(tabular_bundle, tmp_path):
    big = tmp_path / "big.csv"
    with open(big, "w") as handle:
        handle.write("height,weight,color\n")
        for i in range(400_000):
            handle.write(f"{i % 7 - 3}.5,{i % 11 - 5}.25,{('red', 'blue', 'green')[i % 3]}\n")
    preds = tmp_path / "preds.csv"
    preds.write_text("the previous run's predictions\n")
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "inference.py"), "--model", str(tabular_bundle["model"]),
         "--input", str(big), "--output", str(preds), "--chunk_rows", "500", "--quiet", "true"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.glob(".preds.csv.*.tmp")):
        time.sleep(0.05)
    time.sleep(0.3)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert preds.read_text() == "the previous run's predictions\n"
    run = run_cli("inference.py", "--model", tabular_bundle["model"], "--input", big,
                  "--output", preds, "--quiet", "true")
    assert run.returncode == 0, run.stderr[-2000:]
    with open(preds) as handle:
        assert sum(1 for _ in handle) == 400_001  # header + every row


def test_batch_inference_imports_neither_torch_nor_dspy(tabular_bundle, tmp_path):
    new = tmp_path / "new.csv"
    new.write_text("height,weight,color\n1.0,2.0,red\n")
    assert heavy_modules_after("inference.py", "--model", tabular_bundle["model"],
                               "--input", new, "--output", tmp_path / "p.csv",
                               "--quiet", "true") == []
    assert (tmp_path / "p.csv").is_file()


def test_online_ttt_carries_over_from_chunk_to_chunk(tabular_bundle, tmp_path):
    """Online bn adaptation over --input gives the same predictions whether the input is read
    in chunks of 2 batches, of 1.5 batches (rounded up to 2) or at once; episodic differs."""
    from conftest import feature_rows

    rows = feature_rows(per_class=64, seed=5)[:192]
    new = tmp_path / "shifted.csv"  # shifted heights: adaptation has something to do
    new.write_text("height,weight,color\n" + "".join(
        f"{float(r['height'] or 0) + 1.5},{r['weight']},{r['color']}\n" for r in rows))
    outputs = {}
    for name, flags in {"chunks of 64": ["--chunk_rows", "64"],
                        "chunks of 48": ["--chunk_rows", "48"],
                        "at once": ["--chunk_rows", "4096"],
                        "episodic": ["--ttt_mode", "episodic"]}.items():
        out = tmp_path / f"{name}.csv"
        run = run_cli("inference.py", "--model", tabular_bundle["model"], "--input", new,
                      "--output", out, "--ttt", "true", "--ttt_mode", "online",
                      "--ttt_bn_prior", "16", "--batch_size", "32", "--quiet", "true", *flags)
        assert run.returncode == 0, run.stderr[-2000:]
        outputs[name] = out.read_text()
    assert outputs["chunks of 64"] == outputs["at once"] == outputs["chunks of 48"]
    assert outputs["episodic"] != outputs["at once"]


def test_a_row_whose_output_is_not_finite_is_an_error_row():
    """The predict stage every batch path shares (local chunks and Ray workers): a row whose
    probabilities or extra values hold NaN or infinity becomes an error row, never a written
    prediction; its chunk's other rows keep their ids, labels and outputs."""
    import numpy as np

    from ttc.serving.batch import NON_FINITE_OUTPUT, Chunk, RowIds, predict_chunk

    def predict(x):
        probabilities = np.tile([[0.25, 0.75]], (len(x), 1))
        probabilities[x[:, 0] > 1e30] = np.nan
        return probabilities, {"uncertainty": np.where(x[:, 0] < -1e30, np.inf, 0.5)}

    x = np.array([[0.0], [3e38], [1.0], [-3e38]], dtype=np.float32)
    for ids in (["1", "2", "3", "4"], RowIds(np.arange(1, 5))):
        done = predict_chunk(Chunk(ids, x, ["a", None, "b", "a"], [("9", "bad")]), predict)
        assert list(done.ids) == ["1", "3"] and done.labels == ["a", "b"]
        assert done.errors == [("9", "bad"), ("2", NON_FINITE_OUTPUT), ("4", NON_FINITE_OUTPUT)]
        assert np.isfinite(done.probabilities).all() and len(done.probabilities) == 2
        assert done.extra["uncertainty"].tolist() == [0.5, 0.5]
    everything = predict_chunk(Chunk(["1"], x[1:2]), predict)
    assert everything.probabilities is None and everything.errors == [("1", NON_FINITE_OUTPUT)]
