"""Hardening, round 2 (issue 17): no class silently dropped or merged, no user file overwritten,
every path checked before any work, and every bad input of docs/deploy.md's table ending with
its documented exit code, never "unexpected"."""
from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import (FAST_TRAINING, assert_clean_failure, heavy_modules_after, run_cli,
                      write_image_folder)

TABULAR = ["--model_type", "tabular_classifier", *FAST_TRAINING]


def write_rows(path: Path, header: list[str], rows: list[list[object]]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def region_rows(n: int, names: list[str], seed: int = 0) -> list[list[object]]:
    """Two features that separate the classes, the class name last."""
    rng = np.random.default_rng(seed)
    return [[f"{3 * (i % len(names)) + rng.normal():.3f}", f"{rng.normal():.3f}",
             names[i % len(names)]] for i in range(n)]


# ----------------------------------------------------------------------------- 1 and 3: labels


def test_labels_that_look_like_missing_markers_are_classes(tmp_path):
    """NA (North America) and None are class names; only an empty label cell is missing, and
    the dropped rows are counted with their reason. The same rule holds when serving."""
    names = ["NA", "EU", "AS", "None", "null", "N/A"]
    rows = region_rows(360, names)
    rows[10][2] = ""  # truly missing: dropped and reported
    rows[20][2] = "   "
    data = write_rows(tmp_path / "regions.csv", ["x1", "x2", "region"], rows)
    run = run_cli("pipeline.py", *TABULAR, "--dataset_path", data, "--output_model",
                  tmp_path / "m" / "model.onnx", "--report_json", tmp_path / "r.json")
    assert run.returncode == 0, run.stderr[-2000:]
    manifest = json.loads((tmp_path / "m" / "model.json").read_text())
    assert manifest["labels"] == sorted(names)
    dataset = json.loads((tmp_path / "r.json").read_text())["dataset"]
    assert dataset["dropped_rows"] == 2
    assert dataset["dropped_reasons"] == [{"file": str(data), "reason": "missing label",
                                           "count": 2, "first_rows": [11, 21]}]
    assert "dropped 2 rows" in run.stderr and "missing label (rows 11, 21)" in run.stderr

    served = run_cli("inference.py", "--model", tmp_path / "m" / "model.onnx", "--input", data,
                     "--output", tmp_path / "p.csv", "--json", "true")
    assert served.returncode == 0, served.stderr[-2000:]
    predictions = json.loads(served.stdout)["predictions"]
    assert predictions["labeled"] == 358 and predictions["accuracy"] > 0.5
    with open(tmp_path / "p.csv", newline="") as handle:
        truth = {row["true_label"] for row in csv.DictReader(handle)}
    assert truth == set(names) | {""}


def test_numbers_name_one_class_and_mostly_numeric_columns_warn(tmp_path):
    """1, 1.0, +1 and 01 are one class; 2 and 2.00 another. A numeric column with a third of
    its cells unparsable stays numeric, and a code column with a word becomes categorical, each
    with a WARNING naming the column and the count: no silent type change."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(240):
        label = i % 2
        spelled = ["1", "1.0", "+1", "01"][i % 4 // 2 * 2 + (i // 4) % 2] if label else \
            ["2", "2.00"][(i // 2) % 2]
        weight = f"{label * 4 + rng.normal():.3f}" if i % 3 else "heavy"
        plan = ["1", "2", "3", "gold"][i % 4]
        rows.append([weight, plan, spelled])
    data = write_rows(tmp_path / "codes.csv", ["weight", "plan", "label"], rows)
    run = run_cli("pipeline.py", *TABULAR, "--dataset_path", data, "--output_model",
                  tmp_path / "m" / "model.onnx")
    assert run.returncode == 0, run.stderr[-2000:]
    manifest = json.loads((tmp_path / "m" / "model.json").read_text())
    assert manifest["labels"] == ["1", "2"]
    columns = {c["name"]: c for c in manifest["preprocessing"]["columns"]}
    assert columns["weight"]["type"] == "numeric"
    assert columns["plan"] == {"name": "plan", "type": "categorical",
                               "categories": ["1", "2", "3", "gold"]}
    warnings = [line for line in run.stderr.splitlines() if "WARNING" in line]
    weight = [w for w in warnings if "feature column 'weight'" in w]
    plan = [w for w in warnings if "feature column 'plan'" in w]
    assert len(weight) == 1 and "not numbers (e.g. 'heavy')" in weight[0], warnings
    assert len(plan) == 1 and "encoded as categories" in plan[0], warnings


def test_every_label_or_text_empty_is_a_data_error(tmp_path):
    texts = tmp_path / "texts.csv"
    texts.write_text("text,label\n" + ",sports\n" * 20 + ",food\n" * 20)
    labels = tmp_path / "labels.csv"
    labels.write_text("text,label\n" + "a text about rain,\n" * 40)
    for data, phrase in ((texts, "40 with an empty text"), (labels, "40 with a missing label")):
        run = run_cli("pipeline.py", "--model_type", "text_classifier", "--dataset_path", data,
                      "--output_model", tmp_path / "m" / "model.onnx", *FAST_TRAINING)
        assert_clean_failure(run, 3, "no usable rows", phrase)


# ----------------------------------------------------------------------------- 5 and 7: paths


@pytest.fixture()
def bundle_copy(tabular_bundle, tmp_path) -> Path:
    folder = tmp_path / "bundle"
    shutil.copytree(tabular_bundle["dir"], folder)
    return folder


def collision_cases(folder: Path, tmp: Path) -> list[tuple[str, list[object], str]]:
    data = folder / "train.csv"
    (tmp / "link.csv").symlink_to(data)
    os.link(data, tmp / "hard.csv")
    (tmp / "old.csv").write_text("id,label\n1,a\n")
    model = folder / "model.onnx"
    train = ["pipeline.py", *TABULAR, "--dataset_path", data, "--output_model", model]
    serve = ["inference.py", "--model", model, "--input", data]
    return [
        ("report over the manifest", [*train, "--report_json", folder / "model.json"],
         "--report_json"),
        ("report over the dataset", [*train, "--report_json", data], "--dataset_path"),
        ("report over the int8 graph", [*train, "--report_json", folder / "model.int8.onnx"],
         "int8 graph"),
        ("report over the test file", [*train, "--test_path", folder / "test.csv",
                                       "--report_json", folder / "test.csv"], "--test_path"),
        ("output over the input", [*serve, "--output", data], "--input"),
        ("output over the input by a symlink", [*serve, "--output", tmp / "link.csv"],
         "--input"),
        ("output over the input by a hard link", [*serve, "--output", tmp / "hard.csv"],
         "--input"),
        ("errors over the output", [*serve, "--output", tmp / "old.csv", "--errors",
                                    tmp / "old.csv"], "--errors"),
        ("report over the output", [*serve, "--output", tmp / "old.csv", "--report_json",
                                    tmp / "old.csv"], "--output"),
        ("output over the manifest", ["inference.py", "--model", model, "--input", data,
                                      "--output", tmp / "p.csv", "--report_json",
                                      folder / "model.json"], "manifest"),
        ("export report over its own graph", ["export.py", "--output_model", model,
                                              "--report_json", model], "graph"),
    ]


def test_no_output_may_be_an_input_or_another_output(bundle_copy, tmp_path):
    before = {p: digest(p) for p in bundle_copy.rglob("*") if p.is_file()}  # plots/ too
    for name, command, phrase in collision_cases(bundle_copy, tmp_path):
        run = run_cli(*command)
        assert_clean_failure(run, 2, "is the same file as", phrase)
        assert "nothing was read or written" in run.stderr, name
    assert {p: digest(p) for p in before} == before
    assert (tmp_path / "old.csv").read_text() == "id,label\n1,a\n"


@pytest.mark.parametrize("flag", ["--output_model", "--report_json"])
def test_an_unwritable_output_fails_before_training(tmp_path, flag):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    target = blocker / ("model.onnx" if flag == "--output_model" else "report.json")
    args = {"--output_model": tmp_path / "m" / "model.onnx", flag: target}
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", *FAST_TRAINING,
                  *[str(x) for pair in args.items() for x in pair])
    assert_clean_failure(run, 2, flag, "cannot be written", "is a file, not a folder")
    assert "epoch" not in run.stderr and not (tmp_path / "m").exists()


def test_unwritable_batch_outputs_fail_before_reading(tabular_bundle, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    model, data = tabular_bundle["model"], tabular_bundle["dir"] / "train.csv"
    for extra in (["--output", blocker / "p.csv"],
                  ["--output", tmp_path / "p.csv", "--errors", blocker / "e.csv"]):
        run = run_cli("inference.py", "--model", model, "--input", data, *extra)
        assert_clean_failure(run, 2, "cannot be written")
    assert not (tmp_path / "p.csv").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders; the "
                    "'parent is a file' tests above cover the check")
def test_a_read_only_folder_fails_before_training(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", *FAST_TRAINING,
                      "--output_model", locked / "m" / "model.onnx")
        assert_clean_failure(run, 2, "is not writable")
    finally:
        locked.chmod(0o700)


def test_missing_inputs_are_named_by_their_flag_before_work(tmp_path, text_bundle):
    texts = text_bundle["dir"] / "texts.csv"
    for flag in ("--val_path", "--test_path"):
        run = run_cli("pipeline.py", "--model_type", "text_classifier", "--dataset_path", texts,
                      flag, tmp_path / "nope.csv", "--output_model", tmp_path / "m.onnx")
        assert_clean_failure(run, 3, f"{flag} {tmp_path / 'nope.csv'} does not exist")
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--val_path", texts,
                  "--output_model", tmp_path / "m.onnx")
    assert_clean_failure(run, 2, "--val_path and --test_path are for text and tabular tables")


# ----------------------------------------------------------------------------- 6: empty input


def test_an_input_without_rows_leaves_the_old_output(text_bundle, tmp_path):
    old = tmp_path / "preds.csv"
    old.write_text("id,label\n1,food\n")
    header_only = tmp_path / "header.csv"
    header_only.write_text("text,label\n")
    model = text_bundle["model"]
    runs = [run_cli("inference.py", "--model", model, "--input", header_only, "--output", old),
            run_cli("inference.py", "--model", model, "--input", "-", "--output", old, input="")]
    for run in runs:
        assert_clean_failure(run, 3, "has no rows to predict", "left as it was")
    assert old.read_text() == "id,label\n1,food\n"


def test_an_input_whose_every_row_fails_leaves_the_old_output(digits_bundle, tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.png").write_bytes(b"not a png")
    old = tmp_path / "preds.csv"
    old.write_text("previous\n")
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--input", folder,
                  "--output", old, "--errors", tmp_path / "errors.csv")
    assert_clean_failure(run, 3, "none of the 3 rows", "left as it was")
    assert old.read_text() == "previous\n"
    assert len((tmp_path / "errors.csv").read_text().splitlines()) == 4


# ----------------------------------------------------------------------------- 8: manifests


def edited_bundle(source: dict, folder: Path, change) -> Path:
    shutil.copytree(source["dir"], folder)
    manifest = json.loads((folder / "model.json").read_text())
    change(manifest)
    (folder / "model.json").write_text(json.dumps(manifest))
    return folder / "model.onnx"


@pytest.mark.parametrize("bundle,change,phrase", [
    ("digits", lambda m: m.update(labels=m["labels"][:9]), "10 classes and the manifest 9"),
    ("text", lambda m: m.update(labels=m["labels"][:2]), "3 classes and the manifest 2"),
    ("digits", lambda m: m["preprocessing"].update(image_size=[16, 16]), "dimension 2 is 8"),
    ("digits", lambda m: m["preprocessing"].update(channels=3), "dimension 1 is 1"),
    ("text", lambda m: m["preprocessing"]["vocabulary"].extend(f"w{i}" for i in range(999)),
     "differ from those the graph was exported for"),
    ("tabular", lambda m: m["preprocessing"]["columns"].pop(),
     "differ from those the graph was exported for"),
    ("tabular", lambda m: m["preprocessing"].update(median=[0.0] * len(m["preprocessing"]["median"])),
     "differ from those the graph was exported for"),
])
def test_an_edited_manifest_is_refused_before_data(request, tmp_path, bundle, change, phrase):
    source = request.getfixturevalue(f"{bundle}_bundle")
    model = edited_bundle(source, tmp_path / "b", change)
    run = run_cli("inference.py", "--model", model)
    assert_clean_failure(run, 4, "does not match the graph model.onnx", phrase)


def test_an_edited_manifest_is_refused_for_batch_inference(tabular_bundle, tmp_path):
    model = edited_bundle(tabular_bundle, tmp_path / "b",
                          lambda m: m.update(labels=m["labels"][:2]))
    run = run_cli("inference.py", "--model", model, "--input", tabular_bundle["dir"] / "test.csv",
                  "--output", tmp_path / "p.csv")
    assert_clean_failure(run, 4, "3 classes and the manifest 2")


def test_a_header_only_or_object_json_table_is_a_data_error(text_bundle, tmp_path):
    obj = tmp_path / "obj.json"
    obj.write_text('{"text": "rain today", "label": "weather"}')
    nested = tmp_path / "nested.json"
    nested.write_text('{"a": {"text": "rain"}, "b": {"text": "sun"}}')
    header = tmp_path / "header.csv"
    header.write_text("text,label\n")
    for data, phrase in ((obj, "holds a JSON object, not an array of records"),
                         (nested, "holds a JSON object"), (header, "has no data rows")):
        run = run_cli("pipeline.py", "--model_type", "text_classifier", "--dataset_path", data,
                      "--output_model", tmp_path / "m.onnx")
        assert_clean_failure(run, 3, phrase)
    run = run_cli("inference.py", "--model", text_bundle["model"], "--input", obj, "--output",
                  tmp_path / "p.csv")
    assert_clean_failure(run, 3, "holds a JSON object")


# ----------------------------------------------------------------------------- 9: file names


def test_a_file_name_that_is_not_utf8_is_an_error_row(digits_bundle, tmp_path):
    folder = write_image_folder(tmp_path / "imgs", classes=(1, 2), per_class=3)
    good = next((folder / "1").iterdir())
    bad = os.fsencode(folder / "1") + b"/bad\xff name.png"
    with open(bad, "wb") as handle:
        handle.write(good.read_bytes())
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--input", folder,
                  "--output", tmp_path / "p.csv", "--errors", tmp_path / "e.csv",
                  "--allow_errors", "true")
    assert run.returncode == 0, run.stderr[-2000:]
    assert len((tmp_path / "p.csv").read_text().splitlines()) == 1 + 6
    errors = (tmp_path / "e.csv").read_text(encoding="utf-8").splitlines()
    assert errors[1] == f"{folder / '1'}/bad\\xff name.png,the file name is not valid UTF-8; " \
                        "rename the file"


# ----------------------------------------------------------------------------- small things


def test_stage_help_is_light_and_says_what_model_means():
    for script in ("train.py", "export.py", "quantize.py", "inference.py"):
        assert heavy_modules_after(script, "--help") == [], script
    text = run_cli("inference.py", "--help").stdout
    assert "the bundle to read" in " ".join(text.split())


def test_a_batch_size_above_the_data_is_capped_once(tmp_path):
    data = write_rows(tmp_path / "small.csv", ["x1", "x2", "label"],
                      region_rows(60, ["a", "b"]))
    run = run_cli("pipeline.py", *TABULAR, "--dataset_path", data, "--batch_size", "100000",
                  "--output_model", tmp_path / "m" / "model.onnx", "--report_json",
                  tmp_path / "r.json")
    assert run.returncode == 0, run.stderr[-2000:]
    capped = [line for line in run.stderr.splitlines() if "--batch_size 100000" in line]
    assert len(capped) == 1 and "WARNING" in capped[0], run.stderr[-3000:]


# ----------------------------------------------------------------------------- the whole table


def bad_input_sweep(tmp: Path, bundle: Path) -> list[tuple[str, list[object], int]]:
    """One instance of each class of bad input in docs/deploy.md's table that fails fast."""
    files = {"empty.csv": b"", "latin1.csv": "text,label\ncaf\xe9,a\n".encode("latin-1"),
             "broken.json": b"[{\"text\": ", "data.xyz": b"1,2\n", "one.csv": b"text,label\n"
             + b"rain today,weather\n" * 10, "header.csv": b"text,label\n",
             "object.json": b'{"text": "x", "label": "y"}', "ok.csv": b"text,label\n"
             + b"rain today,weather\nsun and goal,sports\n" * 10,
             "no_labels.csv": b"text,label\n" + b"rain today,\n" * 10}
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    (tmp / "no_images").mkdir()
    (tmp / "bad_manifest").mkdir()
    shutil.copy(bundle / "model.onnx", tmp / "bad_manifest" / "model.onnx")
    (tmp / "bad_manifest" / "model.json").write_text("{not json")
    (tmp / "truncated").mkdir()
    for name in ("model.json", "model.pt"):
        shutil.copy(bundle / name, tmp / "truncated" / name)
    (tmp / "truncated" / "model.onnx").write_bytes((bundle / "model.onnx").read_bytes()[:300])
    text = ["pipeline.py", "--model_type", "text_classifier", "--output_model",
            tmp / "m" / "model.onnx", "--dataset_path"]
    serve = ["inference.py", "--model", bundle / "model.onnx", "--output", tmp / "p.csv",
             "--input"]
    return [
        ("missing dataset", [*text, tmp / "nope.csv"], 3),
        ("empty table", [*text, tmp / "empty.csv"], 3),
        ("not UTF-8", [*text, tmp / "latin1.csv"], 3),
        ("unparsable JSON", [*text, tmp / "broken.json"], 3),
        ("unknown file type", [*text, tmp / "data.xyz"], 3),
        ("missing column", [*text, tmp / "ok.csv", "--label_column", "topic"], 3),
        ("one class", [*text, tmp / "one.csv"], 3),
        ("header only", [*text, tmp / "header.csv"], 3),
        ("JSON object", [*text, tmp / "object.json"], 3),
        ("every label empty", [*text, tmp / "no_labels.csv"], 3),
        ("folder without images", ["pipeline.py", "--dataset_path", tmp / "no_images",
                                   "--output_model", tmp / "m" / "model.onnx"], 3),
        ("bad flag value", [*text, tmp / "ok.csv", "--epochs", "-1"], 2),
        ("output over the dataset", [*text, tmp / "ok.csv", "--report_json", tmp / "ok.csv"], 2),
        ("missing --input", [*serve, tmp / "nope.csv"], 3),
        ("header-only --input", [*serve, tmp / "header.csv"], 3),
        ("manifest not JSON", ["inference.py", "--model", tmp / "bad_manifest" / "model.onnx"], 4),
        ("manifest missing", ["inference.py", "--model", tmp / "m2" / "model.onnx"], 4),
        ("truncated graph", ["inference.py", "--model", tmp / "truncated" / "model.onnx"], 4),
    ]


def test_no_bad_input_ends_in_unexpected(text_bundle, tmp_path):
    for name, command, code in bad_input_sweep(tmp_path, text_bundle["dir"]):
        run = run_cli(*command)
        assert "unexpected" not in run.stderr, (name, run.stderr[-1500:])
        assert run.returncode == code, (name, run.returncode, run.stderr[-1500:])
        assert len(run.error_lines()) == 1 and "Traceback" not in run.stderr, name


def test_the_bad_input_table_names_tests_that_exist():
    table = (Path(__file__).parent.parent / "docs" / "deploy.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "test_" in line]
    assert len(rows) >= 30
    for row in rows:
        for name in re.findall(r"test_\w+", row.split("|")[-2]):
            assert (Path(__file__).parent / f"{name}.py").is_file(), (name, row)


# ----------------------------------------------------------------------------- issue 36: 5 and 6


def feature_table(path: Path, columns: list[str], rows: list[dict], header: bool = True) -> Path:
    if not header:
        path.write_text("".join(",".join(r[c] for c in columns) + "\n" for r in rows))
        return path
    return write_rows(path, columns, [[r[c] for c in columns] for r in rows])


def test_split_files_take_the_training_columns_by_name_or_fail(tmp_path):
    """A --val_path/--test_path table is matched by name: reordered columns and extra ones
    train exactly as the training order does; a missing column, or a headerless table with
    another column count, is exit 3 naming it and the file, before any bundle file."""
    from conftest import feature_rows

    rows = feature_rows(seed=9)
    for r in rows:
        r["note"] = "x"
    names = ["height", "weight", "color", "kind"]
    train = feature_table(tmp_path / "train.csv", names, rows[:110])
    tables = {"val.csv": names, "shuffled.csv": ["note", "kind", "color", "height", "weight"]}
    histories = []
    for name, columns in tables.items():
        out = tmp_path / name.removesuffix(".csv")
        run = run_cli("train.py", *TABULAR, "--dataset_path", train, "--label_column", "kind",
                      "--val_path", feature_table(tmp_path / name, columns, rows[110:]),
                      "--output_model", out / "model.onnx", "--report_json", out / "r.json",
                      "--num_threads", "1")
        assert run.returncode == 0, run.stderr[-2000:]
        report = json.loads((out / "r.json").read_text())
        assert report["dataset"]["val"] == 40
        histories.append([{k: v for k, v in epoch.items() if k != "seconds"}
                          for epoch in report["train"]["history"]])
    assert histories[0] == histories[1]
    assert digest(tmp_path / "val" / "model.pt") == digest(tmp_path / "shuffled" / "model.pt")

    bad = [("--test_path", ["height", "weight", "color"], True, ["--test_path", "['kind']"]),
           ("--val_path", ["height", "weight", "kind", "note"], True, ["--val_path", "['color']"]),
           ("--val_path", ["height", "weight", "kind"], False,
            ["--val_path", "has 3 columns and the training table 4", "by position"])]
    for k, (flag, columns, header, phrases) in enumerate(bad):
        split = feature_table(tmp_path / f"bad{k}.csv", columns, rows[110:], header)
        out = tmp_path / f"bad{k}"
        run = run_cli("train.py", *TABULAR, "--dataset_path", train, "--label_column", "kind",
                      flag, split, "--output_model", out / "model.onnx")
        assert_clean_failure(run, 3, f"bad{k}.csv", *phrases)
        assert not out.exists()


def temporal_frame(n: int = 150):
    """A date, a UTC timestamp and a number that give the class away, and a list column."""
    import datetime as dt

    import pyarrow as pa

    rng = np.random.default_rng(3)
    kind = [["early", "late"][i % 2] for i in range(n)]
    days = [dt.date(2020, 1, 1) + dt.timedelta(days=int(400 * (k == "late")) + i)
            for i, k in enumerate(kind)]
    stamps = [dt.datetime(d.year, d.month, d.day, 6, 30, tzinfo=dt.timezone.utc) for d in days]
    return pa.table({
        "x": pa.array(rng.normal(size=n)), "day": pa.array(days, pa.date32()),
        "seen": pa.array(stamps, pa.timestamp("ms", tz="UTC")),
        "tags": pa.array([[k, "t"] for k in kind], pa.list_(pa.string())), "kind": kind})


def test_dates_and_timestamps_are_numbers_in_training_and_serving(tmp_path):
    """docs/data.md: a Parquet date is days since 1970-01-01, a timestamp seconds since the
    Unix epoch (UTC); both are numeric features, read alike at inference, and a CSV holding
    those numbers predicts identically. The unused list column does not stop the run."""
    import pyarrow.parquet as pq

    table = temporal_frame()
    pq.write_table(table, tmp_path / "t.parquet")
    epoch = np.datetime64("1970-01-01")
    numbers = {"x": table["x"].to_pylist(),
               "day": [int((np.datetime64(d) - epoch) // np.timedelta64(1, "D"))
                       for d in table["day"].to_pylist()],
               "seen": [d.timestamp() for d in table["seen"].to_pylist()]}
    write_rows(tmp_path / "t.csv", ["x", "day", "seen", "kind"],
               [[repr(float(numbers["x"][i])), numbers["day"][i], f"{numbers['seen'][i]:.0f}",
                 table["kind"][i].as_py()] for i in range(len(table))])
    model = tmp_path / "m" / "model.onnx"
    run = run_cli("pipeline.py", *TABULAR, "--dataset_path", tmp_path / "t.parquet",
                  "--label_column", "kind", "--feature_columns", "x,day,seen",
                  "--output_model", model, "--num_threads", "1")
    assert run.returncode == 0, run.stderr[-2000:]
    pre = json.loads((tmp_path / "m" / "model.json").read_text())["preprocessing"]
    assert [(c["name"], c["type"]) for c in pre["columns"]] == [
        ("x", "numeric"), ("day", "numeric"), ("seen", "numeric")]
    for name in ("day", "seen"):  # the training mean lies among the documented numbers
        mean = pre["mean"][pre["feature_names"].index(name)]
        assert min(numbers[name]) < mean < max(numbers[name]), (name, mean)
    outputs = []
    for source in ("t.parquet", "t.csv"):
        out = tmp_path / f"{source}.preds.csv"
        served = run_cli("inference.py", "--model", model, "--input", tmp_path / source,
                         "--output", out, "--top_k", "2")
        assert served.returncode == 0, served.stderr[-2000:]
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1] and outputs[0].count("\n") == 151

    # serving refuses a nested cell where the model reads a number
    nested = table.set_column(1, "day", table["tags"])
    pq.write_table(nested, tmp_path / "nested.parquet")
    run = run_cli("inference.py", "--model", model, "--input", tmp_path / "nested.parquet",
                  "--output", tmp_path / "p.csv")
    assert_clean_failure(run, 3, "nested.parquet", "'day' (list<", "flatten")
    assert not (tmp_path / "p.csv").exists()


def test_nested_columns_that_a_run_uses_are_refused(tmp_path):
    """Struct, list and map Parquet columns and JSON arrays or objects have no one value per
    cell: used as features, text or label they are exit 3 naming the column and its type."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 40
    kind = [["a", "b"][i % 2] for i in range(n)]
    x = [float(i % 2) + 0.1 * i for i in range(n)]
    cases = {
        "struct.parquet": (pa.table({"x": x, "where": pa.array(
            [{"lat": v, "lon": -v} for v in x]), "kind": kind}), TABULAR,
            ["'where' (struct<lat: double, lon: double>)"]),
        "map.parquet": (pa.table({"x": x, "attrs": pa.array(
            [[("size", v)] for v in x], pa.map_(pa.string(), pa.float64())), "kind": kind}),
            [*TABULAR, "--feature_columns", "attrs,x"], ["'attrs' (map<string, double"]),
        "words.parquet": (pa.table({"words": pa.array(
            [["rain", "today"] if k == "a" else ["goal", "now"] for k in kind],
            pa.list_(pa.string())), "label": kind}),
            ["--model_type", "text_classifier", *FAST_TRAINING, "--text_column", "words"],
            ["'words' (list<"]),
    }
    for name, (table, flags, phrases) in cases.items():
        pq.write_table(table, tmp_path / name)
    (tmp_path / "objects.jsonl").write_text("".join(
        json.dumps({"x": v, "box": {"w": v}, "kind": k}) + "\n" for v, k in zip(x, kind)))
    cases["objects.jsonl"] = (None, TABULAR, ["'box' (JSON objects)"])
    for name, (_, flags, phrases) in cases.items():
        out = tmp_path / name.replace(".", "_")
        run = run_cli("train.py", *flags, "--dataset_path", tmp_path / name, "--output_model",
                      out / "model.onnx")
        assert_clean_failure(run, 3, name, *phrases, "nested values", "flatten")
        assert not out.exists()
