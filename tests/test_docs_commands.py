"""Every command README.md and docs/*.md show a user, run as the user would type it.

Each page's fenced `bash` lines run, in the page's order, through bash from the root of a copy of
the repository (relative paths, `python` on PATH as the test's interpreter, whose `python X.py`
runs go through the fork server, tests/forkserver.py). Data a clone has not
got (the user's `photos/`, `sms.tsv`, `customers.csv`, `houses.csv`, ...) is laid there first as small
stand-ins under the same names, and a bundle a page reads before any of its commands writes it
(`runs/x/model.onnx`) is built first from a stand-in (once per test worker, on the same stand-in
data, and copied into each checkout that reads it). Three kinds of command do not run as
written, each by a rule below and not by editing the command:
- those that cannot run inside a test suite (NOT_RUN, with the reason);
- training on builtin:digits, builtin:digit_canvases or builtin:digit_boxes, full data sets
  that no stand-in shrinks, runs with `--epochs 2` appended (except README's main command, which runs as
  written), and a compressing one also with `--prune_steps 1 --qat_epochs 1`;
- benchmark scripts run with `--quick` appended (their smoke mode, on the stand-in data) for
  a script's first documented command, and with `--check_flags` (parse the flags, stop) for its
  others, which differ in sizes and rounds that --quick overrides anyway.
A command a page adds must run, or be listed in NOT_RUN: test_every_documented_command_is_run
fails otherwise.
"""
from __future__ import annotations

import atexit
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from conftest import (CLI_ENV, PAGES, REPO, digits_images, feature_rows, fork_server,
                      page_commands, tiny_hf_model, topic_texts)
from test_bench import PRINTS


# Commands that cannot run in a test: the reason, checked against the pages so the list cannot
# go stale.
NOT_RUN = {
    ".venv/bin/python -m pytest -q": "the test suite itself",
    "TTC_TEST_CENSUS=runs/census.jsonl .venv/bin/python -m pytest -q":
        "the test suite itself (tests/test_forkserver.py checks the census it writes)",
    "ray start --head --port 6379 --num-cpus 16": "starts a cluster node that outlives the test",
    "ray start --address HEAD_IP:6379": "joins a cluster that is not there",
    "python serve.py --model /shared/runs/sms/model.onnx --engine ray --ray_address auto "
    "--num_replicas 8 --num_threads 2 --host 0.0.0.0 --port 8000":
        "a multi-node cluster with shared storage (tests/test_serve_ray.py serves on a local one)",
    "python inference.py --model /shared/runs/x/model.onnx --input /shared/in/rows.parquet "
    "--output preds.parquet --engine ray --ray_address auto --num_workers 8 --num_threads 2":
        "a multi-node cluster with shared storage",
    "python pipeline.py --model_type text_classifier --dataset_path sms.tsv --label_column 0 "
    "--text_column 1 --teacher_lm openai/gpt-4o-mini --unlabeled_path new_texts.txt "
    "--output_model runs/sms/model.onnx": "a hosted LM (tests/test_teacher.py runs a local one)",
    "OPENAI_API_KEY=local python pipeline.py --model_type text_classifier --dataset_path sms.tsv "
    "--label_column 0 --text_column 1 --teacher_lm openai/llama3 --teacher_api_base "
    "http://localhost:8000/v1 --unlabeled_path new_texts.txt --output_model runs/sms/model.onnx":
        "an LM server on a fixed port (tests/test_teacher.py runs one on a free port)",
    "python -c \"import transformers as t; t.AutoTokenizer.from_pretrained("
    "'distilbert-base-uncased'); t.AutoModelForSequenceClassification.from_pretrained("
    "'distilbert-base-uncased')\"": "a download from the Hugging Face hub",
    "python pipeline.py --model_type text_classifier --dataset_path sms.tsv --label_column 0 "
    "--text_column 1 --arch hf:distilbert-base-uncased --learning_rate 2e-5 --epochs 5 "
    "--batch_size 32 --quantize dynamic --output_model runs/sms_distilbert/model.onnx":
        "a model from the Hugging Face hub (tests/test_hf.py trains a local tiny one)",
}
# The set-up command's install steps are what .ci/run does; the rest of it runs here.
INSTALL = "python3 -m venv .venv && .venv/bin/pip install -r requirements.txt && "
README_MAIN = ".venv/bin/python pipeline.py --model_type image_classifier --dataset_path " \
              "builtin:digits --output_model runs/digits/model.onnx --report_json " \
              "runs/digits/report.json"
# A provider this machine may not have: --strict_ep makes its absence exit 5, as documented.
NEEDS_GPU = ("--ep tensorrt",)


# A compressing run's fine-tuning cut as its training is (--epochs 2): one pruning step, one
# QAT epoch; every variant is still made, exported, checked and judged.
COMPRESS_SHORT = " --prune_steps 1 --qat_epochs 1"


def bench_script(command: str) -> str | None:
    """The bench script a command runs (its file name), if any."""
    return next((w.removeprefix("bench/") for w in command.split() if w.startswith("bench/")),
                None)


def as_run(page: str, command: str) -> str | None:
    """The command line the test runs for a documented one (None: not run here)."""
    if command in NOT_RUN:
        return None
    if command.startswith(INSTALL):
        command = command[len(INSTALL):]
    words = shlex.split(command)
    if {"builtin:digits", "builtin:digit_canvases", "builtin:digit_boxes"} & set(words) and \
            {"pipeline.py", "train.py"} & set(words) and command != README_MAIN:
        return command + " --epochs 2" + (COMPRESS_SHORT if {"--prune", "--qat"} & set(words)
                                          else "")
    script = bench_script(command)
    if script:
        first = next(c for p in PAGES for c in page_commands(p) if bench_script(c) == script)
        return command + (" --quick" if command == first else " --check_flags")
    return command


def test_every_documented_command_is_run():
    """No page holds a command this file does not run or explain, and NOT_RUN names only
    commands the pages hold."""
    documented = {c for page in PAGES for c in page_commands(page)}
    assert set(NOT_RUN) <= documented, set(NOT_RUN) - documented
    assert any(c.startswith(INSTALL) and c[len(INSTALL):] == README_MAIN
               for c in page_commands("README.md"))
    for page in PAGES:
        for command in page_commands(page):
            unquoted = re.sub(r"'[^']*'", "''", command)  # a JSON body may hold brackets
            assert "..." not in command and "[" not in unquoted.split("#")[0], (page, command)


# ----------------------------------------------------------------------------- stand-in data

SPAM = ["win", "free", "prize", "claim", "cash", "urgent", "call", "txt", "offer", "now"]
HAM = ["see", "you", "later", "lunch", "home", "thanks", "meeting", "tonight", "ok", "love"]


def sms_rows(count: int = 160, seed: int = 0) -> list[tuple[str, str]]:
    """(label, text) in the SMS Spam Collection's layout: ham or spam, words that say which."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        label = "spam" if i % 4 == 0 else "ham"
        words = rng.choice(SPAM if label == "spam" else HAM, rng.integers(3, 8))
        rows.append((label, " ".join(words).capitalize()))
    return rows


def page_files(page: str) -> dict[str, str]:
    """The files a page shows whole: a fenced python block whose first line is `# NAME.py`."""
    text = (REPO / page).read_text(encoding="utf-8")
    return {m.group(1): m.group(2) for m in re.finditer(r"```python\n# (\w+\.py)\n(.*?)```",
                                                        text, re.S)}


def lay_stand_in_data(tree: Path, commands: list[str]) -> None:
    """The user's own data the pages name, small, under the names the pages use."""
    import pandas as pd

    for label, row, img in digits_images((0, 1, 2), 24):
        (tree / "photos" / label).mkdir(parents=True, exist_ok=True)
        img.convert("RGB").save(tree / "photos" / label / f"{row}.png")
        if row % 6 == 0:
            (tree / "incoming").mkdir(exist_ok=True)
            img.convert("RGB").save(tree / "incoming" / f"{row}.png")
    for label, row, img in digits_images((3, 5, 8), 10, size=28):
        (tree / "mnist28" / label).mkdir(parents=True, exist_ok=True)
        img.save(tree / "mnist28" / label / f"{row}.png")
    sms = sms_rows()
    tsv = "".join(f"{label}\t{text}\n" for label, text in sms)
    for name in ("sms.tsv", "sms_spam.tsv"):
        (tree / name).write_text(tsv)
    (tree / "train.tsv").write_text("".join(f"{lb}\t{t}\n" for lb, t in sms[:120]))
    for name, part in (("sst2_train.tsv", sms[:120]), ("sst2_dev.tsv", sms[120:])):
        (tree / name).write_text("".join(f"{t}\t{int(lb == 'ham')}\n" for lb, t in part))
    (tree / "test.tsv").write_text("".join(f"{lb}\t{t}\n" for lb, t in sms[120:]))
    (tree / "messages.txt").write_text("".join(f"{t}\n" for _, t in sms_rows(12, seed=1)))
    (tree / "new.csv").write_text("".join(f"{t}\n" for _, t in sms_rows(12, seed=2)))
    (tree / "new_texts.txt").write_text("".join(f"{t}\n" for _, t in sms_rows(12, seed=3)))
    customers = pd.DataFrame(feature_rows()).rename(columns={"kind": "churned"})
    customers.to_csv(tree / "customers.csv", index=False)
    features = customers.drop(columns="churned").head(30)
    features.to_csv(tree / "new_data.csv", index=False)
    features.to_parquet(tree / "rows.parquet", index=False)
    rng = np.random.default_rng(0)  # a regressor's table: a price from two features and noise
    rooms, area = rng.integers(1, 6, 240), rng.uniform(30, 150, 240)
    pd.DataFrame({"rooms": rooms, "area": area.round(1),
                  "price": (20 * rooms + 2 * area + rng.normal(0, 5, 240)).round(1)}
                 ).to_csv(tree / "houses.csv", index=False)
    if "scans" in " ".join(commands):  # a segmenter's ROOT/images + ROOT/masks
        from ttc.tasks.segment.canvases import write_digit_canvases

        write_digit_canvases(tree / "scans", 40, size=16, seed=0)
    if "shelves" in " ".join(commands):  # a detector's YOLO folder, and its COCO annotations
        from ttc.tasks.detect.canvases import write_coco_canvases, write_yolo_canvases

        write_yolo_canvases(tree / "shelves", 40, size=24, seed=0)
        write_coco_canvases(tree / "shelves" / "images", tree / "instances.json", 40, size=24,
                            seed=0)
    if "hf:tiny_bert" in " ".join(commands):  # transformers is slow to import: only if used
        tiny_hf_model(tree / "tiny_bert", [t for _, t in sms] + [t for t, _ in topic_texts(5)])


# Bundles (and reports) a page may read before writing: how to make each from the stand-ins.
STAND_IN_RUNS = {
    "runs/digits/model.onnx": "python pipeline.py --dataset_path builtin:digits "
                              "--output_model runs/digits/model.onnx --epochs 2",
    "runs/photos/model.onnx": "python pipeline.py --dataset_path photos "
                              "--output_model runs/photos/model.onnx --epochs 3",
    "runs/sms/model.onnx": "python pipeline.py --model_type text_classifier --dataset_path sms.tsv "
                           "--label_column 0 --text_column 1 --output_model runs/sms/model.onnx "
                           "--epochs 3",
    "runs/x/model.onnx": "python pipeline.py --model_type tabular_classifier --dataset_path "
                         "customers.csv --label_column churned --output_model runs/x/model.onnx "
                         "--report_json runs/x/report.json --epochs 3",
    "runs/x/report.json": "python pipeline.py --model_type tabular_classifier --dataset_path "
                          "customers.csv --label_column churned --output_model "
                          "runs/x/model.onnx --report_json runs/x/report.json --epochs 3",
    "runs/shelves/model.onnx": "python pipeline.py --model_type object_detector --dataset_path "
                               "shelves --output_model runs/shelves/model.onnx",
    "cron/2026-11-23.json": "mkdir -p cron && cp runs/x/report.json cron/2026-11-23.json",
    # a census as a suite run writes it (tests/forkserver.py Census): two runs of one test
    "runs/census.jsonl": "mkdir -p runs && printf '%s\\n' "
                         "'{\"test\": \"tests/test_serve.py::test_x (call)\", \"argv\": "
                         "[\"/repo/pipeline.py\", \"--epochs\", \"2\"], \"wall\": 3.1, "
                         "\"cpu\": 2.9}' '{\"test\": \"tests/test_serve.py::test_x (call)\", "
                         "\"argv\": [\"/repo/inference.py\"], \"wall\": 0.5, \"cpu\": 0.4}' "
                         "> runs/census.jsonl",
    # ensemble members: one --seed (one split, one normalisation), other learning rates
    **{f"runs/{name}/model.onnx": f"python pipeline.py --dataset_path builtin:digits "
                                  f"--output_model runs/{name}/model.onnx --epochs 1 "
                                  f"--learning_rate {rate}"
       for rate, name in zip(("1e-3", "3e-3", "1e-2"), "abc")},
}


def served_port(command: str) -> str | None:
    """The port a documented `python serve.py ... --port N` listens on (None: not a server)."""
    words = shlex.split(command)
    if "serve.py" not in words:
        return None
    return words[words.index("--port") + 1] if "--port" in words else "8000"


def reads_and_writes(command: str) -> tuple[list[str], list[str]]:
    """The bundles and reports a command reads and the ones it writes, by its flags; a server
    counts as written by its serve.py command and read by the commands that call its port."""
    words = shlex.split(command)
    reads, writes = [], []
    port = served_port(command)
    if port:
        writes.append(f"localhost:{port}")
    reads += [f"localhost:{p}" for p in re.findall(r"localhost:(\d+)", command) if p != port]
    for flag, value in zip(words, words[1:]):
        if flag == "--model":
            reads.append(value)
        elif flag == "--ensemble":
            reads += value.split(",")
        elif flag in ("--output_model", "--report_json"):
            writes.append(value)
    for reader in ("report.py", "tests/census.py"):
        if reader in words:
            reads.append(words[words.index(reader) + 1])
    if "quantize.py" in words or "export.py" in words:
        reads += [w for f, w in zip(words, words[1:]) if f == "--output_model"]
    return reads, writes


def stand_in_runs(commands: list[str]) -> list[str]:
    """The stand-in runs the page needs: for each bundle or report a command reads before an
    earlier command of the page wrote it, in order (a report's run before a copy of it)."""
    written, needed = set(), []
    for command in commands:
        reads, writes = reads_and_writes(command)
        for path in reads:
            if path not in written and path in STAND_IN_RUNS:
                if path == "cron/2026-11-23.json":
                    needed.append(STAND_IN_RUNS["runs/x/report.json"])
                needed.append(STAND_IN_RUNS[path])
                written.add(path)
        written |= set(writes)
    return list(dict.fromkeys(needed))


# A stand-in pipeline run is made once per test worker, in a checkout of its own on the same
# stand-in data, and its runs/NAME folder copied into each checkout that reads it; the parts
# that read one run on one worker (STAND_IN_GROUP), so that each is made once per suite run.
STAND_IN_GROUP = "docs_stand_ins"
_STAND_IN_TREE: list[Path] = []
_STAND_INS_MADE: set[str] = set()


def stand_in_folder(setup: str) -> str | None:
    """The folder a stand-in pipeline.py run writes (runs/NAME); None for another setup."""
    words = shlex.split(setup)
    if "pipeline.py" not in words:
        return None
    return str(Path(words[words.index("--output_model") + 1]).parent)


def lay_stand_in_run(tree: Path, setup: str) -> None:
    """A setup the page needs, done in `tree`: a stand-in run copied from this worker's stand-in
    checkout (made there the first time), any other setup (a copy) run in the tree."""
    folder = stand_in_folder(setup)
    if folder is None:
        done = run_in(tree, setup)
        assert done.returncode == 0, (setup, done.stderr[-3000:])
        return
    if not _STAND_IN_TREE:
        root = Path(tempfile.mkdtemp(prefix="ttc-stand-ins-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _STAND_IN_TREE.append(user_checkout(root))
        lay_stand_in_data(_STAND_IN_TREE[0], [])
    if setup not in _STAND_INS_MADE:
        done = run_in(_STAND_IN_TREE[0], setup)
        assert done.returncode == 0, (setup, done.stderr[-3000:])
        _STAND_INS_MADE.add(setup)
    shutil.copytree(_STAND_IN_TREE[0] / folder, tree / folder)


def user_checkout(tmp_path: Path) -> Path:
    """A copy of the repository as a user's clone holds it, with `python` on PATH."""
    tree = tmp_path / "checkout"
    shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(
        ".git", ".venv", "runs", "__pycache__", ".pytest_cache", "*.tmp"))
    bin_dir = tree / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    server = fork_server()
    for name in ("python", "python3"):
        shim = bin_dir / name
        if server:
            server.python_shim(shim, tree)
        else:
            shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
            shim.chmod(0o755)
    return tree


def run_in(tree: Path, command: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, **CLI_ENV,
               PATH=f"{tree / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run(["bash", "-c", command], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def expected_codes(command: str) -> set[int]:
    if any(marker in command for marker in NEEDS_GPU):
        return {0, 5}  # 5: the provider cannot start here, and --strict_ep forbids the fallback
    return {0}


def runs_of(page: str) -> list[tuple[str, str]]:
    """(documented, run) for the page's commands that run here. A command an earlier page
    already runs, whose outputs no later command of this page reads, is not run twice."""
    earlier = {c for p in PAGES[:PAGES.index(page)] for c in page_commands(p)}
    runs = [(c, as_run(page, c)) for c in page_commands(page)]
    runs = [(c, r) for c, r in runs if r is not None]
    kept = []
    for i, (documented, command) in enumerate(runs):
        later_reads = {path for _, r in runs[i + 1:] for path in reads_and_writes(r)[0]}
        if documented in earlier and not set(reads_and_writes(command)[1]) & later_reads:
            continue
        kept.append((documented, command))
    return kept


PART_SIZE = 4  # commands per test at most, where the page's order allows a cut


def page_parts(page: str) -> list[list[tuple[str, str]]]:
    """The page's runs in consecutive parts that share nothing (no command reads a bundle or
    report an earlier part wrote), so that xdist can spread a long page over both cores."""
    runs, parts = runs_of(page), []
    for i, run in enumerate(runs):
        if parts and (len(parts[-1]) < PART_SIZE or not _cut_allowed(runs, i)):
            parts[-1].append(run)
        else:
            parts.append([run])
    return parts


def _cut_allowed(runs: list[tuple[str, str]], i: int) -> bool:
    """May runs[i:] start a part of their own: does none of them read what runs[:i] wrote?"""
    written = {path for _, r in runs[:i] for path in reads_and_writes(r)[1]}
    return not any(set(reads_and_writes(r)[0]) & written for _, r in runs[i:])


def page_part_params() -> list:
    """(page, part) for every part; those that read a stand-in run another part reads too in
    STAND_IN_GROUP."""
    setups = {(page, k): [s for s in stand_in_runs([r for _, r in runs]) if stand_in_folder(s)]
              for page in PAGES for k, runs in enumerate(page_parts(page))}
    readers = Counter(s for made in setups.values() for s in made)
    return [pytest.param(*part, marks=[pytest.mark.xdist_group(STAND_IN_GROUP)]
                         if any(readers[s] > 1 for s in made) else [])
            for part, made in setups.items()]


@pytest.mark.parametrize("page,part", page_part_params())
def test_the_page_s_commands_run_as_written(page, part, tmp_path):
    runs = page_parts(page)[part]
    tree = user_checkout(tmp_path)
    lay_stand_in_data(tree, [r for _, r in runs])
    for name, code in page_files(page).items():
        (tree / name).write_text(code)
    for setup in stand_in_runs([r for _, r in runs]):
        lay_stand_in_run(tree, setup)
    with ExitStack() as servers:
        ports: dict[str, int] = {}
        for documented, command in runs:
            if served_port(command):
                ports[served_port(command)] = servers.enter_context(
                    documented_server(tree, command))
                continue
            check_documented_run(page, documented, on_ports(command, ports), tree)


def on_ports(command: str, ports: dict[str, int]) -> str:
    """A command calling a documented server's port, on the free port it was started on."""
    return re.sub(r"localhost:(\d+)", lambda m: f"localhost:{ports.get(m.group(1), m.group(1))}",
                  command)


SERVER_START_S = 180  # a local Ray cluster, Serve and two replicas on a busy 2-core machine


@contextmanager
def documented_server(tree: Path, command: str) -> Iterator[int]:
    """A documented `python serve.py ...` (the one rule: on a free port, not the page's, since
    pages run side by side), started in the background and ready before the next command runs:
    it said it serves on that port (Ray Serve: once every replica is up) and answers ready.
    SIGTERM at the end of the page, as a user's Ctrl-C, must end it with exit 0, nothing on
    stdout. A port another process took between the probe and the server's bind (the server
    says so, exit 5) is a race of this test's, not the server's: tried again on another."""
    for _ in range(3):
        port = free_port()
        log, out = tree.parent / f"server-{port}.err", tree.parent / f"server-{port}.out"
        server = start_documented_server(tree, command, port, log, out)
        if wait_until_serving(server, port, log):
            break
        assert server.returncode == 5 and f"127.0.0.1:{port}" in log.read_text(), (
            command, server.returncode, log.read_text()[-3000:])
    else:
        pytest.fail(f"{command}: each of 3 free ports was taken before the server bound it")
    try:
        yield port
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    err = log.read_text()
    assert server.returncode == 0, (command, server.returncode, err[-3000:])
    assert "Traceback" not in err, (command, err[-3000:])
    assert out.read_text() == "", (command, out.read_text()[-3000:])


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_documented_server(tree: Path, command: str, port: int, log: Path,
                            out: Path) -> subprocess.Popen:
    words = shlex.split(command)
    words = [*words, "--port", str(port)] if "--port" not in words else \
        [str(port) if k > 0 and words[k - 1] == "--port" else w for k, w in enumerate(words)]
    env = dict(os.environ, **CLI_ENV,
               PATH=f"{tree / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    with log.open("w") as stderr, out.open("w") as stdout:
        return subprocess.Popen(words, cwd=tree, env=env, stdin=subprocess.DEVNULL,
                                stdout=stdout, stderr=stderr)


def wait_until_serving(server: subprocess.Popen, port: int, log: Path) -> bool:
    """True once the server logged its line for http://127.0.0.1:PORT and answers ready there;
    False if it exited first."""
    import urllib.request

    deadline = time.monotonic() + SERVER_START_S
    while server.poll() is None:
        assert time.monotonic() < deadline, f"not serving in {SERVER_START_S} s: " \
            f"{log.read_text()[-3000:]}"
        if f"on http://127.0.0.1:{port} " in log.read_text():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready",
                                            timeout=2) as ready:
                    if ready.status == 200:
                        return True
            except OSError:
                pass
        time.sleep(0.3)
    return False


def check_documented_run(page: str, documented: str, command: str, tree: Path) -> None:
    done = run_in(tree, command)
    assert done.returncode in expected_codes(command), (
        page, documented, done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, (page, documented, done.stderr[-3000:])
    if done.returncode == 5:
        assert "execution provider" in done.stderr, done.stderr[-2000:]
    if "--report_json -" in command:
        json.loads(done.stdout)
    if command.startswith("curl "):  # a server's answer, never an error status
        assert '"detail"' not in done.stdout and '"error"' not in done.stdout, (
            documented, done.stdout[-2000:])
    # a bench asked for some of its phases (--phases) prints only theirs
    script = bench_script(command) if "--quick" in command and "--phases" not in command else None
    for words in PRINTS.get(script, ()):
        assert words in done.stdout, (documented, words, done.stdout[-3000:])
