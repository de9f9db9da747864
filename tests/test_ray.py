"""Batch inference on Ray (`inference.py --input ... --engine ray`) against the local engine:
the same ids, labels, probabilities and error rows on text, tabular (Parquet) and image-folder
inputs; a worker killed mid-run, and a run interrupted (SIGINT, and SIGTERM while the cluster
starts and mid-run: no process of it left); a running cluster joined by address; flags refused
before Ray starts; Parquet in and out (tabular, text and image-path tables; Ctrl-C while a
Parquet output is written).

The tests that compare the engines join the test worker's running head node (conftest's
ray_cluster, as `--ray_address` joins a cluster); those that kill or interrupt a run start a
local cluster of the machine's CPUs (2 on the machine they were written on), as a run without
--ray_address does. They share one xdist worker (one cluster at a time: the killing test must
find its own workers)."""
from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import (REPO, Run, assert_clean_failure, descendants, feature_rows,
                      heavy_modules_after, run_cli, topic_texts, write_image_folder)

pytestmark = pytest.mark.xdist_group("ray")


def read_rows(path: Path) -> pd.DataFrame:
    """Predictions as strings and floats, whatever the output format."""
    if path.suffix == ".parquet":
        frame = pd.read_parquet(path)
    elif path.suffix == ".jsonl":
        frame = pd.read_json(path, lines=True, dtype=False)
    else:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    for name in frame.columns:
        if "probability" in name or name in ("confidence", "entropy", "std"):
            frame[name] = frame[name].astype(float)
        else:
            frame[name] = frame[name].fillna("").astype(str)
    return frame


def assert_same_predictions(local: Path, ray: Path) -> pd.DataFrame:
    a, b = read_rows(local), read_rows(ray)
    assert list(a.columns) == list(b.columns)
    assert len(a) == len(b) > 0
    for name in a.columns:
        if a[name].dtype == float:
            # within 1e-6, plus one step of the outputs' rounding to 6 decimals (other batch
            # sizes sum in another order: a 1e-8 difference can cross a rounding boundary)
            assert np.abs(a[name].to_numpy() - b[name].to_numpy()).max() <= 2e-6, name
        else:
            assert (a[name].to_numpy() == b[name].to_numpy()).all(), name
    return a


def both_engines(model, tmp_path: Path, data: Path, suffix: str, *args: object,
                 ray_args: tuple = ()) -> tuple[Path, Path, dict]:
    """Predict `data` with each engine (exit 0 expected); the outputs and the Ray run's
    report (printed as JSON on stdout: nothing of Ray's may leak there)."""
    outputs = []
    report = None
    for engine in ("local", "ray"):
        out = tmp_path / engine / f"preds{suffix}"
        extra = ["--engine", "ray", "--json", "true", *ray_args] if engine == "ray" else []
        run = run_cli("inference.py", "--model", model, "--input", data, "--output", out,
                      "--errors", tmp_path / engine / "errors.csv", "--allow_errors", "true",
                      "--no_progress", "true", *args, *extra)
        assert run.returncode == 0, run.stderr[-3000:]
        if engine == "ray":
            report = json.loads(run.stdout)
        outputs.append(out)
    errors = [(tmp_path / e / "errors.csv").read_text() for e in ("local", "ray")]
    assert errors[0] == errors[1]
    return outputs[0], outputs[1], report


def test_tabular_parquet_on_ray_matches_local_with_bad_rows(tabular_bundle, ray_cluster,
                                                            tmp_path):
    rows = feature_rows(per_class=400, seed=3)
    rows[5]["weight"], rows[900]["height"] = "heavy", "tall"  # two rows that cannot be encoded
    frame = pd.DataFrame(rows)
    frame["weight"] = frame["weight"].astype(object)
    data = tmp_path / "new.parquet"
    frame.to_parquet(data, row_group_size=300)  # 4 row groups: read by several tasks
    local, ray, report = both_engines(tabular_bundle["model"], tmp_path, data, ".parquet",
                                      "--top_k", "2", "--chunk_rows", "128",
                                      ray_args=("--num_workers", "2", "--ray_address",
                                                ray_cluster))
    preds = assert_same_predictions(local, ray)
    assert len(preds) == 1198 and list(preds["id"][:3]) == ["1", "2", "3"]
    assert "6" not in set(preds["id"]) and "901" not in set(preds["id"])
    failed = list(csv.DictReader(open(tmp_path / "ray" / "errors.csv")))
    assert [r["id"] for r in failed] == ["6", "901"]
    engine = report["engine"]
    assert engine["engine"] == "ray" and engine["workers"] == 2 and engine["rows"] == 1200
    assert engine["failed_rows"] == 2 and engine["threads_per_worker"] == 1
    assert engine["worker_batch_size"] == 128 and engine["first_batch_s"] > 0
    assert report["predictions"]["accuracy"] > 0.8


def test_texts_on_ray_match_local(text_bundle, ray_cluster, tmp_path):
    data = tmp_path / "texts.csv"
    texts = topic_texts(per_class=60, seed=5)
    data.write_text("text,label\n" + "".join(f'"{t}",{label}\n' for t, label in texts)
                    + '"",sports\n"=cmd|calc",\n')
    local, ray, report = both_engines(text_bundle["model"], tmp_path, data, ".jsonl",
                                      "--top_k", "3", ray_args=("--worker_batch_size", "40",
                                                                 "--ray_address", ray_cluster))
    preds = assert_same_predictions(local, ray)
    assert len(preds) == 182 and preds["true_label"].iloc[-1] == ""
    assert report["engine"]["worker_batch_size"] == 40


def test_image_folder_with_episodic_ttt_on_ray_matches_local(digits_bundle, ray_cluster,
                                                             tmp_path):
    folder = write_image_folder(tmp_path / "new", classes=(1, 4, 8), per_class=20)
    (folder / "4" / "broken.png").write_bytes(b"not a png")
    local, ray, _ = both_engines(digits_bundle["model"], tmp_path, folder, ".csv", "--ttt",
                                 "true", "--ttt_method", "bn", "--batch_size", "16",
                                 "--chunk_rows", "32",
                                 ray_args=("--ray_address", ray_cluster))
    preds = assert_same_predictions(local, ray)
    assert len(preds) == 60 and set(preds["true_label"]) == {"1", "4", "8"}
    failed = list(csv.DictReader(open(tmp_path / "ray" / "errors.csv")))
    assert len(failed) == 1 and failed[0]["id"].endswith("broken.png")


def worker_pids(pid: int) -> set[int]:
    """The processes below `pid` that are Ray actors running our predictor (Ray names them by
    the class): this run's own, not those of a Ray run beside it."""
    return {p for p, command in descendants(pid).items() if "PredictWorker" in command}


def test_a_worker_killed_mid_run_loses_no_row_and_an_interrupt_leaves_no_output(
        tabular_bundle, ray_cluster, tmp_path):
    # 12,000 rows in 6 parts of 2,000: the first part's predictions are written while 5 parts
    # are still to come, and the worker is killed then
    frame = pd.DataFrame(feature_rows(per_class=400, seed=4) * 10)
    data = tmp_path / "many.parquet"
    frame.to_parquet(data, row_group_size=2000)
    out = tmp_path / "ray" / "preds.csv"
    args = [sys.executable, str(REPO / "inference.py"), "--model", tabular_bundle["model"],
            "--input", data, "--no_progress", "true", "--chunk_rows", "64"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([*map(str, args), "--output", str(out), "--engine", "ray",
                             "--worker_batch_size", "64"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = None
    deadline = time.time() + 240
    while killed is None and time.time() < deadline and proc.poll() is None:
        written = [p for p in out.parent.glob(".preds.csv.*.tmp") if p.stat().st_size > 2000]
        pids = worker_pids(proc.pid)
        if written and pids:  # predictions are flowing: kill a worker in the middle
            killed = min(pids)
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=600)
    assert killed is not None, "the run ended before a worker could be killed"
    assert proc.returncode == 0, stderr[-3000:]
    # Four times the rows (48,000): the run is cut a few seconds after its first rows. SIGINT as
    # from a terminal: a runner started in the background (`cmd &`, nohup) ignores SIGINT, its
    # children inherit that, and the tool rightly keeps an ignored SIGINT ignored (the cut run
    # then finished, exit 0: the failures of 27 November 2026, first blamed on the input's size).
    # On the running cluster: a local cluster's own interruption is the SIGTERM test's
    more = tmp_path / "more.parquet"
    pd.concat([frame] * 4).to_parquet(more, row_group_size=2000)
    interrupted = subprocess.Popen([*map(str, args[:5]), str(more), *map(str, args[6:]),
                                    "--output", str(tmp_path / "cut.csv"), "--engine", "ray",
                                    "--worker_batch_size", "64", "--ray_address", ray_cluster],
                                   cwd=REPO, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                    signal.SIG_DFL))
    deadline = time.time() + 240
    while time.time() < deadline and interrupted.poll() is None and not any(
            p.stat().st_size > 2000 for p in tmp_path.glob(".cut.csv.*.tmp")):
        time.sleep(0.01)
    assert interrupted.poll() is None, "the run ended before it could be interrupted"
    interrupted.send_signal(signal.SIGINT)  # mid-run: nothing half-written is left behind
    _, stderr = interrupted.communicate(timeout=300)
    assert interrupted.returncode == 130, stderr[-2000:]
    assert not list(tmp_path.glob("*cut.csv*"))
    local = tmp_path / "local" / "preds.csv"
    run = run_cli("inference.py", *args[2:], "--output", local)
    assert run.returncode == 0, run.stderr[-2000:]
    preds = assert_same_predictions(local, out)
    assert list(preds["id"]) == [str(i) for i in range(1, 12_001)]  # each row once, in order


def test_joins_a_running_cluster_and_refuses_more_workers_than_it_holds_or_a_taken_port(
        tabular_bundle, ray_cluster, tmp_path):
    """A head node an operator started (`ray start --head`, conftest's ray_cluster)."""
    data = tmp_path / "new.csv"
    rows = pd.DataFrame(feature_rows(per_class=30, seed=6))
    rows.loc[20, "weight"] = "heavy"  # its chunk's column is read as text, the others as numbers
    rows.to_csv(data, index=False)
    out = tmp_path / "preds.parquet"
    base = ["--model", tabular_bundle["model"], "--input", data, "--output", out,
            "--engine", "ray", "--ray_address", ray_cluster, "--no_progress", "true",
            "--chunk_rows", "16", "--allow_errors", "true"]
    run = run_cli("inference.py", *base, "--num_workers", "3")
    assert_clean_failure(run, 2, "--num_workers 3", "needs 3 CPUs", "has 2")
    assert not out.exists()
    run = run_cli("inference.py", *base, "--report_json", tmp_path / "report.json")
    assert run.returncode == 0, run.stderr[-3000:]
    engine = json.loads((tmp_path / "report.json").read_text())["engine"]
    assert engine["address"].endswith(ray_cluster.rsplit(":", 1)[1])
    preds = read_rows(out)
    assert len(preds) == 89 and "21" not in set(preds["id"])
    assert (preds["label"] == preds["true_label"]).mean() > 0.8
    # serve.py on the joined cluster, whose node has the port taken: Ray Serve's proxy cannot
    # bind it (as when another process takes a port a local cluster's run checked): one line
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        run = run_cli("serve.py", "--model", tabular_bundle["model"], "--engine", "ray",
                      "--ray_address", ray_cluster, "--num_threads", "1", "--port", port)
    # Ray relays its Serve controller's shutdown log ("(raylet) Task ServeController... RPC
    # error: ...") on stderr now and then: a log line of Ray's, not the tool's error line
    own = Run(run.returncode, run.stdout, "\n".join(
        line for line in run.stderr.splitlines() if "(raylet)" not in line))
    assert_clean_failure(own, 5, f"could not start its controller and HTTP proxy on "
                         f"127.0.0.1:{port}", "Failed to bind", "choose another --port")
    assert run.stdout == ""  # the relayed lines go to stderr: nothing but the summary on stdout


def test_ray_flags_are_checked_before_any_work(tabular_bundle, tmp_path):
    data = tmp_path / "new.csv"
    pd.DataFrame(feature_rows(per_class=5)).to_csv(data, index=False)
    model, out = tabular_bundle["model"], tmp_path / "preds.csv"
    broken = tmp_path / "broken.parquet"
    broken.write_text("height,weight\n1,2\n")  # CSV text under a Parquet name
    cases = [
        (["--engine", "ray"], 2, "--engine ray predicts --input"),
        (["--input", data, "--output", out, "--num_workers", "2"], 2,
         "--num_workers applies only to --engine ray"),
        (["--input", data, "--output", out, "--engine", "ray", "--ttt", "true", "--ttt_mode",
          "online"], 2, "--ttt_mode online"),
        (["--input", data, "--output", out, "--engine", "ray", "--num_workers", "0"], 2,
         "num_workers"),
        (["--input", "-", "--output", out, "--engine", "ray"], 2, "--input -"),
        (["--input", data, "--output", out, "--engine", "ray", "--ttt", "true",
          "--ttt_method", "all"], 2, "predictions need one"),  # checked before any worker
        (["--input", broken, "--output", out, "--engine", "ray"], 3, "cannot parse"),
        (["--input", broken, "--output", out], 3, "as PARQUET"),
        (["--input", data, "--output", out, "--engine", "ray", "--ray_address",
          "127.0.0.1:1"], 5, "no Ray cluster answers at"),
    ]
    for args, code, phrase in cases:
        started = time.time()
        run = run_cli("inference.py", "--model", model, *args, timeout=120)
        assert_clean_failure(run, code, phrase)
        assert time.time() - started < 60
        assert not out.exists()


def test_parquet_round_trip_and_training_from_parquet(tmp_path):
    """Train on a Parquet file, predict another into Parquet, read it back; the local engine
    reads Parquet without Ray."""
    import pyarrow.parquet as pq

    rows = pd.DataFrame(feature_rows(per_class=60, seed=7))
    rows["height"] = pd.to_numeric(rows["height"])  # typed columns, with nulls where missing
    rows["weight"] = pd.to_numeric(rows["weight"])
    rows.iloc[:150].to_parquet(tmp_path / "train.parquet")
    rows.iloc[150:].drop(columns="kind").to_parquet(tmp_path / "new.parquet")
    model = tmp_path / "bundle" / "model.onnx"
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  tmp_path / "train.parquet", "--label_column", "kind", "--epochs", "12",
                  "--batch_size", "16", "--output_model", model, "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    out = tmp_path / "preds.parquet"
    args = ["--model", model, "--input", tmp_path / "new.parquet", "--output", out,
            "--top_k", "2", "--no_progress", "true"]
    assert "ray" not in heavy_modules_after("inference.py", *args,
                                            modules=("torch", "dspy", "ray"))
    table = pq.read_table(out)
    assert table.column_names == ["id", "label", "confidence", "top2_label",
                                  "top2_probability"]
    assert str(table.schema.field("id").type) == "string"
    assert str(table.schema.field("confidence").type) == "double"
    preds = table.to_pandas()
    assert list(preds["id"]) == [str(i) for i in range(1, 31)]
    truth = rows.iloc[150:]["kind"].to_numpy()
    assert (preds["label"].to_numpy() == truth).mean() > 0.8
    probs = preds[["confidence", "top2_probability"]].to_numpy()
    assert (probs[:, 0] >= probs[:, 1]).all() and (probs.sum(1) <= 1 + 1e-6).all()


def test_parquet_and_csv_of_one_table_are_read_alike(tmp_path):
    """The same cells in Parquet (typed: integers, nulls, floats) and in CSV give the same
    encoded rows and labels: one reading rule for both."""
    from ttc.serving.batch import BatchOptions, TableReader

    manifest = {"model_type": "tabular_classifier", "labels": ["1", "2", "3.5"], "dataset": {},
                "preprocessing": {"kind": "tabular", "columns": [
                    {"name": "h", "type": "numeric"},
                    {"name": "c", "type": "categorical", "categories": ["red", "blue"]}]}}
    frame = pd.DataFrame({"h": [1.5, None, 3.0, 4.25], "c": ["red", None, "blue", ""],
                          "label": pd.array([1, 2, None, 2], dtype="Int64")})
    frame.loc[3, "label"] = 2
    frame.to_parquet(tmp_path / "t.parquet")
    (tmp_path / "t.csv").write_text("h,c,label\n1.5,red,1\n,,2\n3.0,blue,\n4.25,,2\n")
    chunks = {}
    for name in ("t.parquet", "t.csv"):
        path = tmp_path / name
        options = BatchOptions(str(path), "o.csv", 2, label_column="label")
        chunks[name] = list(TableReader(path, manifest, options))
    for a, b in zip(chunks["t.parquet"], chunks["t.csv"], strict=True):
        assert a.ids == b.ids and a.labels == b.labels and a.errors == b.errors
        np.testing.assert_array_equal(a.x, b.x)
    assert [c.labels for c in chunks["t.csv"]] == [["1", "2"], [None, "2"]]


def test_text_and_image_path_tables_from_parquet_predict_as_from_csv(text_bundle, digits_bundle,
                                                                     tmp_path):
    """Parquet input of texts and of image paths (relative to the table), local engine: the
    same predictions as the same table in CSV."""
    from conftest import write_image_table

    texts = pd.DataFrame(topic_texts(per_class=20, seed=8), columns=["text", "label"])
    texts.loc[3, "text"] = None  # an empty text is predicted too
    images = pd.read_csv(write_image_table(tmp_path / "imgs", "csv", classes=(2, 5),
                                           per_class=10))
    for name, model, frame in (("texts", text_bundle["model"], texts),
                               ("imgs/table", digits_bundle["model"], images)):
        frame.to_csv(tmp_path / f"{name}.csv", index=False)
        frame.to_parquet(tmp_path / f"{name}.parquet")
        outputs = []
        for suffix in (".csv", ".parquet"):
            out = tmp_path / "out" / f"{name.replace('/', '_')}{suffix}.jsonl"
            run = run_cli("inference.py", "--model", model, "--input",
                          tmp_path / f"{name}{suffix}", "--output", out, "--top_k", "2",
                          "--no_progress", "true")
            assert run.returncode == 0, run.stderr[-2000:]
            outputs.append(out)
        preds = assert_same_predictions(*outputs)
        assert len(preds) == len(frame)


# ----------------------------------------------------------------------------- issue #36


def ray_failing_on_import(folder: Path) -> tuple[dict, Path]:
    """An environment in which importing ray leaves a marker file and fails: a run in it that
    exits without the marker never started (or imported) Ray."""
    marker = folder / "ray-was-imported"
    package = folder / "fake" / "ray"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                         "raise ImportError('ray must not be imported')\n")
    return {"PYTHONPATH": str(package.parent)}, marker


def test_more_local_workers_than_cpus_and_malformed_addresses_fail_before_ray(
        tabular_bundle, tmp_path):
    """A local cluster has this machine's CPUs: more workers x threads than those is exit 2
    before Ray starts (it was sized to the request and hung with --num_workers 1000000); a
    --ray_address that is no host:port, auto or local is exit 2 too (it was exit 5)."""
    cpus = len(os.sched_getaffinity(0))
    data = tmp_path / "new.csv"
    pd.DataFrame(feature_rows(per_class=5)).to_csv(data, index=False)
    out = tmp_path / "preds.csv"
    env, marker = ray_failing_on_import(tmp_path)
    base = ["--model", tabular_bundle["model"], "--input", data, "--output", out, "--engine",
            "ray"]
    cases = [(["--num_workers", "1000000"], "--num_workers 1000000", "needs 1000000 CPUs"),
             (["--num_workers", str(cpus + 1)], f"needs {cpus + 1} CPUs",
              f"local Ray cluster has this machine's {cpus}"),
             (["--num_threads", str(cpus + 1)], f"one Ray worker with {cpus + 1} threads"),
             (["--num_workers", "2", "--num_threads", str(cpus), "--ray_address", "local"],
              f"needs {2 * cpus} CPUs")]
    cases += [(["--ray_address", address], f"invalid --ray_address {address!r}",
               "expected host:port, auto or local")
              for address in ("host:", "host:99999", "host:0", "a b:1", "garbage", "http://x",
                              ":::", "10.0.0.1:6379:1", "[not-ipv6]:1", "ray://10.0.0.1:10001")]
    for args, *phrases in cases:
        started = time.time()
        run = run_cli("inference.py", *base, *args, timeout=60, extra_env=env)
        assert_clean_failure(run, 2, *phrases)
        assert time.time() - started < 30, args
    assert not marker.exists() and not out.exists()


def still_running(pids: dict[int, str]) -> dict[int, str]:
    """Those of `pids` that still run the same command (not exited, no zombie)."""
    alive = {}
    for pid, command in pids.items():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            now = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            continue
        if state != "Z" and now == command:
            alive[pid] = command
    return alive


def test_sigterm_while_ray_starts_and_mid_run_exits_130_and_leaves_no_ray_process(
        tabular_bundle, tmp_path):
    """SIGTERM (as a scheduler stops a job) while the local cluster starts, and again once its
    workers predict: exit 130 with one `interrupted` line and nothing after it (it was exit 15,
    or 139, and left ray::DashboardAgent / RuntimeEnvAgent running), no output, and no process
    of the run's cluster left."""
    frame = pd.DataFrame(feature_rows(per_class=400, seed=9) * 25)  # 30,000 rows
    data = tmp_path / "many.parquet"
    frame.to_parquet(data, row_group_size=5000)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for moment in ("cluster start", "workers predicting"):
        out = tmp_path / moment.replace(" ", "_") / "preds.csv"
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "inference.py"), "--model",
             str(tabular_bundle["model"]), "--input", str(data), "--output", str(out),
             "--engine", "ray", "--no_progress", "true", "--chunk_rows", "64"], cwd=REPO,
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen: dict[int, str] = {}
        wanted = "raylet" if moment == "cluster start" else "PredictWorker"
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and not any(
                wanted in command for command in seen.values()):
            seen.update(descendants(proc.pid))
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before {moment}"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 130, (moment, stderr[-2000:])
        assert stderr.strip().splitlines()[-1] == "inference.py: interrupted", stderr[-2000:]
        assert "Traceback" not in stderr and "SIGTERM received" not in stderr, stderr[-2000:]
        assert not list(out.parent.glob("*preds.csv*"))
        left = still_running(seen)
        grace = time.time() + 10  # a worker forked in the last instant, before its raylet died
        while left and time.time() < grace:
            time.sleep(0.2)
            left = still_running(left)
        assert not left, (moment, left)


def test_sigint_while_a_parquet_output_is_written_prints_one_line_and_keeps_the_old_one(
        tabular_bundle, tmp_path):
    """Ctrl-C once the first Parquet row group of 65,536 rows is on disk, with 234,464 rows to
    go: exit 130, `interrupted` and nothing after it (pyarrow's ParquetWriter used to close
    itself later, onto the closed file: "Exception ignored ... write to closed file"), no
    temporary file, the previous output as it was."""
    data = tmp_path / "many.parquet"
    pd.DataFrame(feature_rows(per_class=400, seed=10) * 250).to_parquet(data)  # 300,000 rows
    out = tmp_path / "preds.parquet"
    out.write_bytes(b"the previous predictions")
    proc = subprocess.Popen([sys.executable, str(REPO / "inference.py"), "--model",
                             str(tabular_bundle["model"]), "--input", str(data), "--output",
                             str(out), "--no_progress", "true"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and not any(
            p.stat().st_size > 4096 for p in tmp_path.glob(".preds.parquet.*.tmp")):
        time.sleep(0.01)
    # past the row group's write_table: Ctrl-C inside that call printed nothing even before
    time.sleep(0.3)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == "inference.py: interrupted", stderr[-2000:]
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many.parquet", "preds.parquet"]
    assert out.read_bytes() == b"the previous predictions"
