"""Helpers shared by the tests: run the CLIs as subprocesses and write small real datasets."""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import locale
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
FAST_TRAINING = ["--epochs", "4", "--no_progress", "true"]


# The pages whose commands a user copies (tests/test_docs_commands.py runs them).
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]


def page_commands(page: str) -> list[str]:
    """The page's fenced bash commands, one per command: continuation lines joined, comments
    and blank lines dropped."""
    text = (REPO / page).read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = " ".join(_without_comment(line).split())
            if command:
                commands.append(command)
    return commands


def _without_comment(line: str) -> str:
    """A shell line without its trailing comment (a # that starts a word, outside quotes)."""
    quote, out = None, []
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            break
        out.append(char)
    return "".join(out).strip()


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if "error:" in line]


# The environment every CLI run of the tests gets (and the fork server is started with).
CLI_ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def run_cli(script: str, *args: str, timeout: int = 600, extra_env: dict | None = None,
            cwd: Path = REPO, **popen: object) -> Run:
    """`python REPO/script args` from `cwd` (the repository root unless a test gives relative
    paths from another folder); through the fork server (the same run, without the imports)
    unless `popen` asks for what only a fresh process does (a preexec_fn, input on stdin)."""
    env = dict(os.environ, **CLI_ENV, **(extra_env or {}))
    argv = [str(REPO / script), *map(str, args)]
    server = fork_server() if not popen else None
    if server:
        return server.run(argv, cwd, env, timeout)
    proc = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, **popen)
    return Run(proc.returncode, proc.stdout, proc.stderr)


class ForkServer:
    """tests/forkserver.py serving this test worker: started on first use, gone with it."""

    def __init__(self, folder: Path) -> None:
        self.socket = folder / "fork.sock"
        self.process = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "forkserver.py"), str(self.socket)],
            cwd=REPO, env=dict(os.environ, **CLI_ENV), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        ready = self.process.stdout.readline()
        assert ready.strip() == "ready", f"the fork server did not start: {ready!r}"

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> Run:
        """One CLI run (argv[0] the script), as subprocess.run(capture_output=True) returns it."""
        import forkserver  # tests/, beside this file

        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
                open(os.devnull, "rb") as stdin, \
                socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(self.socket))
            pid = forkserver.send_request(sock, argv, str(cwd), env,
                                          (stdin.fileno(), out.fileno(), err.fileno()))
            sock.settimeout(timeout)
            try:
                code = forkserver.read_status(sock)
            except TimeoutError:
                os.kill(pid, 9)
                raise subprocess.TimeoutExpired(argv, timeout) from None
            return Run(code, _text(out), _text(err))

    def python_shim(self, path: Path, root: Path) -> None:
        """An executable `python` at `path` that runs `python X.py ...` through this server for
        the scripts under `root` (and anything else, `python -c ...`, as the real interpreter).
        A script run so has the shim as its sys.executable: the CLI runs a bench script makes
        fork too."""
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S '
                        f'"{REPO / "tests" / "forkserver.py"}" --client "{self.socket}" '
                        f'"{root}" "$0" "$@"\n')
        path.chmod(0o755)


def _text(file) -> str:
    """What a child wrote, decoded as subprocess.run(text=True) decodes it."""
    file.seek(0)
    data = file.read().decode(locale.getpreferredencoding(False))
    return data.replace("\r\n", "\n").replace("\r", "\n")


_SERVER: list[ForkServer] = []


def fork_server() -> ForkServer | None:
    """This worker's fork server; None where TTC_TESTS_FORK=0 asks for fresh interpreters."""
    if os.environ.get("TTC_TESTS_FORK", "1") == "0" or not hasattr(os, "fork"):
        return None
    if not _SERVER:
        folder = Path(tempfile.mkdtemp(prefix="ttc-fork-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _SERVER.append(ForkServer(folder))
    return _SERVER[0]


def heavy_modules_after(script: str, *args: str, modules=("torch", "dspy")) -> list[str]:
    """Run a CLI in a fresh interpreter (it must exit 0) and list which of `modules` it
    imported."""
    code = ("import runpy, sys\n"
            f"sys.argv = [{script!r}, *{[str(a) for a in args]!r}]\n"
            f"try:\n    runpy.run_path({script!r}, run_name='__main__')\n"
            "except SystemExit as exit:\n    assert exit.code == 0, exit.code\n"
            f"print('imported:' + ','.join(m for m in {tuple(modules)!r} if m in sys.modules))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    last = [line for line in run.stdout.splitlines() if line.startswith("imported:")][-1]
    return [m for m in last.removeprefix("imported:").split(",") if m]


def assert_clean_failure(run: Run, code: int, *phrases: str) -> None:
    """Exit `code`, exactly one 'error:' line on stderr mentioning `phrases`, no traceback."""
    assert run.returncode == code, (run.returncode, run.stderr[-2000:])
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    lines = run.error_lines()
    assert len(lines) == 1, run.stderr[-2000:]
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


def chromium_screenshot(page: Path, shot: Path, width: int, height: int) -> None:
    """Headless Chromium draws `page` into the PNG `shot` at width x height (.ci/run installs
    it: apt-get install chromium)."""
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not installed: .ci/run installs it (apt-get install chromium)"
    run = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={shot.parent / 'chromium-profile'}",
         "--hide-scrollbars", f"--window-size={width},{height}", f"--screenshot={shot}",
         page.as_uri()], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and shot.is_file(), run.stderr[-3000:]


def digits_images(classes: tuple[int, ...], per_class: int, size: int = 16):
    """Real handwritten digits (scikit-learn's bundled set) as 8-bit grayscale PIL images."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for label in classes:
        rows = np.flatnonzero(digits.target == label)[:per_class]
        for row in rows:
            pixels = (digits.images[row] * 255 / 16).astype(np.uint8)
            yield str(label), int(row), Image.fromarray(pixels).resize((size, size), Image.NEAREST)


def write_image_folder(root: Path, classes=(0, 1, 2), per_class: int = 40, rgb: bool = False,
                       splits: bool = False) -> Path:
    """ROOT/<class>/*.png, or ROOT/{train,test}/<class>/*.png with splits=True (1 in 4 to test)."""
    for label, row, img in digits_images(classes, per_class):
        folder = root / ("test" if row % 4 == 0 else "train") / label if splits else root / label
        folder.mkdir(parents=True, exist_ok=True)
        (img.convert("RGB") if rgb else img).save(folder / f"{row}.png")
    return root


def write_image_table(root: Path, fmt: str, classes=(0, 1, 2), per_class: int = 40) -> Path:
    """A CSV or JSONL table of relative image paths and labels, the images beside it."""
    records = []
    for label, row, img in digits_images(classes, per_class):
        (root / "imgs").mkdir(parents=True, exist_ok=True)
        img.save(root / "imgs" / f"{row}.png")
        records.append({"file": f"imgs/{row}.png", "digit": f"d{label}"})
    path = root / f"table.{fmt}"
    if fmt == "csv":
        path.write_text("file,digit\n" + "".join(f"{r['file']},{r['digit']}\n" for r in records))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# Each pipeline run costs seconds of fixed start-up, export and inference work, whatever the
# data: the session-scoped bundles below are trained once and shared by every test that only
# inspects or reuses them. A test that changes a bundle's files copies its folder first.

# Session fixtures are built once per xdist worker: the tests of the costlier bundles go to one
# worker together (--dist loadgroup in pytest.ini), so that each is built once per run. So do
# the tests of a module's own trained fixture (a module fixture is also built once per worker).
# A test that takes a bundle by name (request.getfixturevalue(f"{name}_bundle"), parametrized)
# goes with that bundle's tests too. digits_bundle (quick, and used in most test files) is left to
# both workers.
GROUPED_BUNDLES = ("hf_pad1_bundle", "hf_bundle", "wine_bundle", "digits_int8_bundle",
                   "text_bundle", "tabular_bundle")
GROUPED_MODULE_FIXTURES = ("source_bundle", "split_folder", "news_bundle", "transformer",
                           "model_def_bundle", "useless_run", "compressed", "segment_bundle",
                           "detect_bundle", "tta_graph", "int8_bundle", "exported",
                           "quick", "bundle")  # bench/device_check.py's run; a regressor's
# A fixture that a grouped bundle is made from: its other tests join that bundle's group.
GROUP_OF = {"hf_model_dir": "hf_bundle"}


@pytest.hookimpl(wrapper=True)  # around xdist's own hook, which reads the marks
def pytest_collection_modifyitems(config: pytest.Config,
                                   items: list[pytest.Item]) -> Iterator[None]:
    groups = {}
    for item in items:
        marks = [m.args[0] if m.args else m.kwargs.get("name", "default")
                 for m in item.iter_markers("xdist_group")]  # a file's own group (test_ray.py)
        group = marks[0] if marks else shared_setup(item)
        if group and not marks:
            item.add_marker(pytest.mark.xdist_group(group))
        if group:
            groups[item] = group
    result = yield
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        for item, group in groups.items():
            _group_in_node_id(item, group)
    return result


def shared_setup(item: pytest.Item) -> str | None:
    """The costly shared fixture whose worker runs this test: one it requests, or one a
    parameter names ("text" or "text_bundle" for request.getfixturevalue)."""
    requested = set(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None) if "request" in requested else None
    for value in (callspec.params.values() if callspec else ()):
        if isinstance(value, str):
            requested |= {value, f"{value}_bundle"}
    name = next((n for n in (*GROUPED_BUNDLES, *GROUPED_MODULE_FIXTURES, *GROUP_OF)
                 if n in requested), None)
    return GROUP_OF.get(name, name)


def _group_in_node_id(item: pytest.Item, group: str) -> None:
    """xdist 3.8 tells the controller a test's group by appending "@group" to `item._nodeid`,
    which pytest 9.2 no longer reads (its node id is the structured `item._id`): without this,
    every grouped test is scheduled alone and each worker trains every bundle
    (pytest-dev/pytest-xdist#1386). Where xdist's suffix shows (older pytest, a fixed
    xdist), nothing is done. tests/test_scheduling.py fails if a pytest release breaks this."""
    node_id = getattr(item, "_id", None)
    if "@" not in item.nodeid.rsplit("]", 1)[-1] and hasattr(type(node_id), "parse"):
        item._id = type(node_id).parse(f"{item.nodeid}@{group}")


# ----------------------------------------------------------------------------- a running cluster
# The Ray tests that compare a run on Ray with the local engine join one head node per test
# worker (`--ray_address`), started as an operator starts one, instead of each run starting and
# stopping a local cluster of its own (8-10 s each on two cores). A local cluster's own start,
# stop and interruption stay tested: by the tests that kill or interrupt runs, by
# tests/test_serve_ray.py and by the pages' commands (tests/test_docs_commands.py).
RAY_GROUP = "ray"  # the xdist group of every test that starts or joins a Ray cluster


@dataclass
class RayHead:
    process: subprocess.Popen
    address: str


_RAY_HEAD: list[RayHead] = []


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def start_ray_head() -> RayHead:
    """`ray start --head --block` with 2 CPUs, every port its own (test workers and other runs
    on this machine start heads too), ready once its GCS port accepts a connection. With its
    dashboard: Ray Train's end-of-run watcher on a joined cluster asks it (driver.trainer_class)."""
    port, dashboard, agent, client = free_ports(4)
    ray = Path(sys.executable).with_name("ray")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    process = subprocess.Popen(
        [str(ray), "start", "--head", "--block", "--num-cpus", "2", "--port", str(port),
         "--dashboard-port", str(dashboard), "--dashboard-agent-listen-port", str(agent),
         "--ray-client-server-port", str(client), "--disable-usage-stats"], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return RayHead(process, f"127.0.0.1:{port}")
        except OSError:
            assert process.poll() is None, f"`ray start --head` exited {process.returncode}"
            assert time.monotonic() < deadline, "`ray start --head` did not open its port"
            time.sleep(0.5)


def stop_ray_head() -> None:
    """This worker's head node and every process of it (the session `ray start` began) killed
    at once: SIGTERM makes `ray start --block` drain the node, which after a job waits out a
    30 s timeout."""
    while _RAY_HEAD:
        head = _RAY_HEAD.pop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.process.pid, signal.SIGKILL)
        head.process.wait(timeout=120)


def ray_head() -> str:
    """The address (127.0.0.1:PORT) of this test worker's running head node of 2 CPUs: started
    on first use, stopped after the last test of the Ray group in a row (a module fixture of a
    Ray test may ask too)."""
    if not _RAY_HEAD:
        _RAY_HEAD.append(start_ray_head())
    return _RAY_HEAD[0].address


@pytest.fixture()
def ray_cluster() -> str:
    """ray_head(): the running cluster a test joins by --ray_address."""
    return ray_head()


atexit.register(stop_ray_head)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _RAY_HEAD and not (nextitem and _in_ray_group(nextitem)):
        stop_ray_head()


def _in_ray_group(item: pytest.Item) -> bool:
    return any(m.args[:1] == (RAY_GROUP,) for m in item.iter_markers("xdist_group"))


def pipeline_bundle(out: Path, *args: object) -> dict:
    """pipeline.py into out/model.onnx with out/report.json; it must exit 0."""
    model = out / "model.onnx"
    run = run_cli("pipeline.py", *args, "--output_model", model, "--report_json",
                  out / "report.json", "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    return {"dir": out, "model": model, "run": run,
            "report": json.loads((out / "report.json").read_text())}


SEGMENT_SIDE, DETECT_SIDE = 20, 32  # the tiny canvases of the segmenter's and detector's bundles


@pytest.fixture(scope="session")
def segment_bundle(tmp_path_factory) -> dict:
    """A segmenter trained on tiny digit canvases, shared by its CLI and serving tests."""
    from ttc.tasks.segment.canvases import write_digit_canvases

    root = tmp_path_factory.mktemp("segment")
    data = write_digit_canvases(root / "canvases", 80, size=SEGMENT_SIDE, seed=0)
    out = root / "run"
    model = out / "model.onnx"
    run = run_cli("pipeline.py", "--model_type", "image_segmenter", "--dataset_path", data,
                  "--epochs", "2", "--batch_size", "16", "--tta", "true", "--ttt", "true",
                  "--quantize", "static", "--force_quantized", "true",
                  "--eval_shift", "gaussian_noise", "--output_model", model, "--report_json",
                  out / "report.json", "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    return {"data": data, "dir": out, "model": model, "run": run,
            "report": json.loads((out / "report.json").read_text())}


@pytest.fixture(scope="session")
def detect_bundle(tmp_path_factory) -> dict:
    """A detector trained on tiny COCO canvases, shared by its CLI and serving tests."""
    from ttc.tasks.detect.canvases import write_coco_canvases

    root = tmp_path_factory.mktemp("detect")
    images, annotations = root / "images", root / "instances.json"
    write_coco_canvases(images, annotations, 80, size=DETECT_SIDE, seed=0)
    out = root / "run"
    model = out / "model.onnx"
    run = run_cli("pipeline.py", "--model_type", "object_detector", "--dataset_path", images,
                  "--annotations", annotations, "--epochs", "2", "--batch_size", "16",
                  "--max_detections", "20", "--ttt", "true", "--eval_shift", "contrast",
                  "--tta", "true",
                  "--output_model", model, "--report_json",
                  out / "report.json", "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    return {"images": images, "annotations": annotations, "dir": out, "model": model,
            "run": run, "report": json.loads((out / "report.json").read_text())}


# The bundles whose tests check a temperature baked into every graph (test_calibration.py,
# test_iterative.py, test_hf_ttc.py): the fitted T applied even where its validation split shows
# no evidence for it (docs/calibration.md), as before issue 41.
T_APPLIED = ("--calibrate", "temperature_always")


@pytest.fixture(scope="session")
def digits_bundle(tmp_path_factory) -> dict:
    """One full pipeline run on builtin:digits, shared by the tests that inspect its artifacts.
    Its report goes to stdout (--report_json -), so the run also shows that stdout is then
    nothing but the JSON report."""
    out = tmp_path_factory.mktemp("digits")
    model = out / "model.onnx"
    run = run_cli("pipeline.py", "--model_type", "image_classifier", "--dataset_path",
                  "builtin:digits", "--output_model", model, "--report_json", "-",
                  *FAST_TRAINING, *T_APPLIED)
    assert run.returncode == 0, run.stderr[-3000:]
    return {"dir": out, "model": model, "run": run, "report": json.loads(run.stdout)}


@pytest.fixture(scope="session")
def digits_int8_bundle(tmp_path_factory) -> dict:
    """builtin:digits with a statically quantized int8 graph and the human summary on stdout."""
    return pipeline_bundle(tmp_path_factory.mktemp("digits_int8"), "--dataset_path",
                           "builtin:digits", "--quantize", "static", "--calibration_size", "128",
                           "--epochs", "4", *T_APPLIED)


@pytest.fixture(scope="session")
def wine_bundle(tmp_path_factory) -> dict:
    """builtin:wine (default epochs) with the optional stages that tabular tests inspect, all in
    one run: an fp16 graph, a 3-member ensemble, TTA, and TTT under two feature shifts."""
    return pipeline_bundle(tmp_path_factory.mktemp("wine"), "--model_type", "tabular_classifier",
                           "--dataset_path", "builtin:wine", "--batch_size", "32",
                           "--fp16", "true", "--ensemble_size", "3",
                           "--tta", "true", "--tta_transforms", "jitter:0.2,jitter:0.1",
                           "--tta_merge", "gmean",
                           "--ttt", "true", "--ttt_bn_prior", "16",
                           "--eval_shift", "feature_noise,feature_scale", *T_APPLIED)


TOPICS = {
    "sports": ["match", "goal", "team", "score", "player", "coach", "league", "win", "referee"],
    "food": ["recipe", "bake", "flavor", "dinner", "spicy", "oven", "salad", "taste", "garlic"],
    "weather": ["rain", "sunny", "forecast", "storm", "wind", "cloudy", "snow", "humid", "fog"],
}
FILLER = ["the", "a", "today", "really", "very", "and", "with", "some", "was", "our", "!"]


def topic_texts(per_class: int = 50, seed: int = 0) -> list[tuple[str, str]]:
    """Short texts whose topic words give the label away, mixed with shared filler words."""
    rng = np.random.default_rng(seed)
    rows = []
    for label, words in TOPICS.items():
        for _ in range(per_class):
            tokens = list(rng.choice(words, rng.integers(2, 4))) + list(
                rng.choice(FILLER, rng.integers(2, 6)))
            rng.shuffle(tokens)
            rows.append((" ".join(tokens).capitalize(), label))
    order = rng.permutation(len(rows))
    return [rows[i] for i in order]


def feature_rows(per_class: int = 50, seed: int = 0) -> list[dict]:
    """Tabular rows: two numeric features, one categorical, a few missing cells."""
    rng = np.random.default_rng(seed)
    colors = {"a": ["red", "red", "blue"], "b": ["blue", "green"], "c": ["green", "red"]}
    centers = {"a": (0.0, 5.0), "b": (3.0, 0.0), "c": (-3.0, -4.0)}
    rows = []
    for label, (cx, cy) in centers.items():
        for i in range(per_class):
            rows.append({"height": f"{cx + rng.normal():.3f}" if i % 17 else "",
                         "weight": f"{cy + rng.normal():.3f}",
                         "color": str(rng.choice(colors[label])), "kind": label})
    return [rows[i] for i in rng.permutation(len(rows))]


# Small data, but trained long enough that the accuracy floors in the tests hold with room.
TABLE_TRAINING = ["--epochs", "12", "--batch_size", "16"]


@pytest.fixture(scope="session")
def text_bundle(tmp_path_factory) -> dict:
    """A text classifier trained on a messy CSV: a byte-order mark, a header, a blank line, an
    empty text and an unlabelled text among topic_texts()."""
    out = tmp_path_factory.mktemp("text")
    lines = ["text,label"] + [f'"{t}",{label}' for t, label in topic_texts()]
    lines[5:5] = ["", ',sports', '"an unlabelled text",']  # blank line, empty text, no label
    (out / "texts.csv").write_text("\ufeff" + "\n".join(lines) + "\n", encoding="utf-8")
    return pipeline_bundle(out, "--model_type", "text_classifier", "--dataset_path",
                           out / "texts.csv", *TABLE_TRAINING)


@pytest.fixture(scope="session")
def tabular_bundle(tmp_path_factory) -> dict:
    """A tabular classifier trained on feature_rows(): a CSV with a header, a categorical column
    and missing cells (the first 120 rows), and a given test file without a header (the rest)."""
    out = tmp_path_factory.mktemp("tabular")
    rows = [",".join(row.values()) + "\n" for row in feature_rows()]
    (out / "train.csv").write_text("height,weight,color,kind\n" + "".join(rows[:120]))
    (out / "test.csv").write_text("".join(rows[120:]))
    return pipeline_bundle(out, "--model_type", "tabular_classifier", "--dataset_path",
                           out / "train.csv", "--label_column", "kind", "--test_path",
                           out / "test.csv", *TABLE_TRAINING)


def tiny_hf_model(folder: Path, texts: list[str], *, pad_token: str = "[PAD]") -> Path:
    """A tiny BERT (2 layers, hidden 32) with a WordPiece tokenizer trained on `texts`, written
    by save_pretrained as a hub checkpoint would be: what `--arch hf:<folder>` loads. No
    download: the weights are random, so training them is training from scratch."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    specials = [pad_token, "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    if pad_token != "[PAD]":  # the pad id is not 0: e.g. RoBERTa's <pad> is 1
        specials = ["[UNK]", pad_token, "[CLS]", "[SEP]", "[MASK]"]
    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=300,
                                                                 special_tokens=specials))
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                        pad_token=pad_token, cls_token="[CLS]",
                                        sep_token="[SEP]", mask_token="[MASK]",
                                        model_max_length=64)
    tokenizer.save_pretrained(folder)
    config = BertConfig(vocab_size=backend.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                        pad_token_id=tokenizer.pad_token_id)
    import torch

    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory) -> Path:
    """tiny_hf_model trained on topic_texts(): `--arch hf:<this folder>`."""
    return tiny_hf_model(tmp_path_factory.mktemp("tiny_bert"), [t for t, _ in topic_texts()])


@pytest.fixture(scope="session")
def hf_bundle(tmp_path_factory, hf_model_dir) -> dict:
    """The tiny BERT fine-tuned on topic_texts() through the whole pipeline, with dynamic int8:
    the bundle the transformers tests inspect."""
    out = tmp_path_factory.mktemp("hf")
    lines = ["text,label"] + [f'"{t}",{label}' for t, label in topic_texts()]
    (out / "texts.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return pipeline_bundle(out, "--model_type", "text_classifier", "--dataset_path",
                           out / "texts.csv", "--arch", f"hf:{hf_model_dir}",
                           "--learning_rate", "3e-3", "--epochs", "8", "--batch_size", "16",
                           "--quantize", "dynamic", *T_APPLIED)


@pytest.fixture(scope="session")
def hf_pad1_bundle(tmp_path_factory) -> dict:
    """A tiny BERT whose tokenizer pads with id 1, fine-tuned by one pipeline run that also
    trains a 3-member ensemble and reports TTA (token dropout, in the graph), Tent under the
    text shifts, and the ensemble."""
    out = tmp_path_factory.mktemp("hf_pad1")
    folder = tiny_hf_model(out / "bert", [t for t, _ in topic_texts()], pad_token="<pad>")
    lines = ["text,label"] + [f'"{t}",{label}' for t, label in topic_texts()]
    (out / "texts.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return pipeline_bundle(out, "--model_type", "text_classifier", "--dataset_path",
                           out / "texts.csv", "--arch", f"hf:{folder}", "--learning_rate", "3e-3",
                           "--epochs", "8", "--batch_size", "16", "--num_threads", "1",
                           "--ensemble_size", "3", "--tta", "true", "--tta_transforms",
                           "token_dropout:0.2,token_dropout:0.1", "--ttt", "true",
                           "--ttt_method", "tent", "--eval_shift", "unknown_tokens,token_deletion",
                           *T_APPLIED)


# ----------------------------------------------------------------------------- hostile copies
# The untrusted-bundle tests edit copies of the session bundles as an attacker would.


# --pretrained's MobileNetV3-Large (MobileNet_V3_Large_Weights.IMAGENET1K_V1), the backbone of
# the segmenters' and the detector's torchvision networks, as torch hub names it
BACKBONE_FILE = "mobilenet_v3_large-8738ca79.pth"
MARKED = "features.16.0.weight"  # the backbone's last conv: filled with MARK in the fake file
MARK = 0.25


def fake_hub_cache(home: Path) -> dict:
    """ImageNet-shaped MobileNetV3-Large weights made here (no network), under the file name
    torch hub uses in TORCH_HOME=home; one tensor holds a value no fresh initialisation has."""
    import torch
    import torchvision

    torch.manual_seed(1)
    state = torchvision.models.mobilenet_v3_large(weights=None).state_dict()
    state[MARKED].fill_(MARK)
    path = home / "hub" / "checkpoints" / BACKBONE_FILE
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    return state


def trains_from_the_fake_hub_cache(train: Callable[[], subprocess.CompletedProcess], home: Path,
                                   out: Path) -> tuple[dict, dict]:
    """--pretrained's backbone for a segmenter or a detector (`train` runs the CLI into `out`
    with TORCH_HOME=home): refused with exit 3 while the hub cache lacks the file (nothing
    downloaded, no bundle), then trained from the fake file (fake_hub_cache). Checks what they
    share (every backbone tensor loaded, the RGB filters summed for the grayscale canvases, the
    manifest's ImageNet normalisation, the marked conv still about MARK after a few small
    steps, which no fresh initialisation of it is near); returns the report's init_weights
    and the file's state."""
    import torch

    run = train()
    expected = home / "hub" / "checkpoints" / BACKBONE_FILE
    assert_clean_failure(run, 3, str(expected), "does not download")
    assert not expected.exists() and not (out / "model.pt").exists()
    state = fake_hub_cache(home)
    run = train()
    assert run.returncode == 0, run.stderr[-3000:]
    init = json.loads((out / "report.json").read_text())["train"]["init_weights"]
    backbone = [k for k in state if k.startswith("features.")]
    assert init["tensors_in_file"] == len(state) and init["loaded"] == len(backbone)
    assert any("RGB filters summed" in note for note in init["notes"])
    assert json.loads((out / "model.json").read_text())["architecture"]["normalization"] == \
        "imagenet"
    marked = torch.load(out / "model.pt", weights_only=True)["body.backbone.16.0.weight"]
    assert marked.shape == state[MARKED].shape and abs(float(marked.mean()) - MARK) < 0.05
    return init, state


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def deflate_in_place(path: Path) -> None:
    """A torch file's ZIP entries deflated in place (torch.save stores them as they are): the
    archive torch.load would inflate whole, as a ZIP bomb does."""
    import zipfile

    with zipfile.ZipFile(path) as plain:
        entries = [(info.filename, plain.read(info)) for info in plain.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as packed:
        for name, data in entries:
            packed.writestr(name, data)


def copy_bundle(bundle: dict, folder: Path) -> Path:
    """The bundle's model.* files copied into `folder`; the copy's model.onnx."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in Path(bundle["dir"]).glob("model.*"):
        shutil.copy(path, folder / path.name)
    return folder / "model.onnx"


def edit_manifest(model: Path, change) -> dict:
    """Apply change(manifest) to the bundle's model.json; the manifest written."""
    path = model.with_suffix(".json")
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))
    return manifest


def descendants(pid: int) -> dict[int, str]:
    """The live processes below `pid` (zombies count as gone), with their command lines."""
    parents, commands = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(
                b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z":
            parents[int(entry.name)] = int(parent)
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return {p: commands.get(p, "") for p in found}
