"""Untrusted bundle files: a bundle's own Python file (model.def.py) runs only with
--trust_model_code, and every file the tool reads from a bundle (manifest, graphs, weights,
tokenizer, model definition, external data) is a regular file in the bundle's folder within a
size limit, checked before it is opened: links (even to a matching copy beside them), FIFOs,
devices, folders and 1 TB sparse files are refused at once, and a decoy beside the bundle is
never read. Every hostile bundle is a copy of a session bundle, edited as an attacker would
(hashes in the manifest recomputed)."""
from __future__ import annotations

import json
import os
import resource
import shutil
import stat
import time
from pathlib import Path

import pytest

from conftest import assert_clean_failure, copy_bundle, edit_manifest, run_cli, sha256

TRUST_HINT = "pass --trust_model_code true if you trust whoever made this bundle"
FAST = ["--no_progress", "true", "--num_threads", "1"]

MODEL_DEF = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, channels, num_classes):
        super().__init__()
        self.conv = nn.Conv2d(channels, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, num_classes)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))).mean(dim=(2, 3)))


def build(num_classes, input_spec):
    return Net(input_spec["channels"], num_classes)
'''

# What an attacker appends to the bundle's copy: code run at import and in the factory.
PAYLOAD = '''
open({marker!r}, "a").write("imported\\n")
_build = build


def build(num_classes, input_spec):
    open({marker!r}, "a").write("factory\\n")
    return _build(num_classes, input_spec)
'''


# ----------------------------------------------------------------------------- helpers








def untouched(path: Path) -> Path:
    """`path` with its access time set to 0: any read of it sets it to now."""
    os.utime(path, (0, path.stat().st_mtime))
    return path


@pytest.fixture(scope="module")
def atime_moves(tmp_path_factory) -> bool:
    """Whether a read updates a file's access time on this file system (relatime does, from 0);
    where it does not, the never-read checks are skipped, not the tests."""
    control = untouched(_write(tmp_path_factory.mktemp("atime") / "control", "x"))
    control.read_text()
    return control.stat().st_atime != 0


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def assert_never_read(atime_moves: bool, *paths: Path) -> None:
    for path in paths:
        assert not atime_moves or os.stat(path).st_atime == 0, f"{path} was read"


def decoy_beside(folder: Path) -> Path:
    """A file beside the bundle's folder that no bundle may make the tool read."""
    return untouched(_write(folder.parent / "decoy.csv", "password,host\nhunter2,db\n"))


def timed_cli(seconds: float, script: str, *args: object):
    """run_cli with a timeout, asserting that the run took well under it."""
    start = time.monotonic()
    run = run_cli(script, *map(str, args), timeout=int(seconds) + 60)
    elapsed = time.monotonic() - start
    assert elapsed < seconds, f"{script} took {elapsed:.1f} s"
    return run


# ----------------------------------------------------------------------------- --model_def bundle


@pytest.fixture(scope="module")
def model_def_bundle(tmp_path_factory) -> dict:
    """A --model_def network trained by pipeline.py on builtin:digits, Tent included: the user's
    own file, trained in the same process, needs no --trust_model_code."""
    root = tmp_path_factory.mktemp("model_def")
    source = _write(root / "mynet.py", MODEL_DEF)
    out = root / "bundle"
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--model_def",
                  f"{source}:build", "--epochs", "1", "--ttt", "true", "--ttt_method", "tent",
                  "--plots", "none", "--output_model", out / "model.onnx", "--report_json", "-",
                  *FAST)
    assert run.returncode == 0, run.stderr[-3000:]
    return {"dir": out, "model": out / "model.onnx", "report": json.loads(run.stdout)}


def hostile_model_def(bundle: dict, folder: Path, factory: str = "build") -> tuple[Path, Path]:
    """A copy of the bundle whose model.def.py also writes a marker file (at import and in the
    factory), its sha256 recomputed in the manifest; the model and the marker's path."""
    model = copy_bundle(bundle, folder)
    marker = folder.parent / "MARKER"
    definition = folder / "model.def.py"
    definition.write_text(MODEL_DEF + PAYLOAD.format(marker=str(marker)))
    digest = sha256(definition)

    def change(manifest: dict) -> None:
        manifest["architecture"]["model_def"].update(sha256=digest, factory=factory)
        manifest["files"]["sha256"]["model_def"] = digest

    edit_manifest(model, change)
    return model, marker


def test_the_users_own_model_def_runs_tent_without_the_flag(model_def_bundle):
    report = model_def_bundle["report"]
    assert report["train"]["network"] == "UserNetwork"
    assert report["ttt"]["clean"]["accuracy_tent"] is not None


@pytest.mark.parametrize("script,args", [
    ("export.py", []),
    ("inference.py", ["--ttt", "true", "--ttt_method", "tent"]),
    ("inference.py", ["--ttt", "true", "--ttt_method", "all", "--trust_model_code", "false"]),
    ("inference.py", ["--ttt", "true", "--ttt_method", "tent", "--input", "{decoy}",
                      "--output", "{decoy}.out.csv"]),
])
def test_a_bundles_python_file_never_runs_without_trust(model_def_bundle, tmp_path, atime_moves,
                                                        script, args):
    model, marker = hostile_model_def(model_def_bundle, tmp_path / "bundle")
    decoy = decoy_beside(model.parent)
    weights = untouched(model.with_suffix(".pt"))
    definition = untouched(model.with_suffix(".def.py"))
    flag = "--output_model" if script == "export.py" else "--model"
    run = timed_cli(30, script, flag, model, *[a.format(decoy=decoy) for a in args], *FAST)
    assert_clean_failure(run, 2, "this bundle's network is Python code", f"import {definition}",
                         "call its build()", "nothing was imported", TRUST_HINT)
    assert not marker.exists()
    assert_never_read(atime_moves, decoy, weights, definition)


def test_a_factory_name_from_the_manifest_is_quoted_on_one_line(model_def_bundle, tmp_path):
    """A name that is no Python identifier: quoted and escaped (or refused by the manifest's
    schema), never printed raw."""
    model, marker = hostile_model_def(model_def_bundle, tmp_path / "bundle",
                                      factory="build\n\x1b[31mok: all fine")
    run = timed_cli(30, "inference.py", "--model", model, "--ttt", "true", "--ttt_method",
                    "tent", *FAST)
    assert run.returncode in (2, 4) and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert len(run.error_lines()) == 1 and "\x1b" not in run.stderr
    if run.returncode == 2:
        assert "call its factory 'build\\n\\x1b[31mok: all" in run.error_lines()[0]
    assert not marker.exists()


def test_serving_the_graph_never_imports_the_bundles_code(model_def_bundle, tmp_path):
    """Plain inference and BatchNorm adaptation run ONNX Runtime only: no flag, no import."""
    model, marker = hostile_model_def(model_def_bundle, tmp_path / "bundle")
    for args in ([], ["--ttt", "true", "--ttt_method", "bn"]):
        run = timed_cli(60, "inference.py", "--model", model, *args, *FAST)
        assert run.returncode == 0, run.stderr[-2000:]
    assert not marker.exists()


def test_trust_model_code_lets_export_and_tent_run_the_bundles_code(model_def_bundle, tmp_path):
    model, marker = hostile_model_def(model_def_bundle, tmp_path / "bundle")
    run = timed_cli(120, "inference.py", "--model", model, "--ttt", "true", "--ttt_method",
                    "tent", "--trust_model_code", "true", *FAST)
    assert run.returncode == 0, run.stderr[-2000:]
    assert marker.read_text() == "imported\nfactory\n"
    run = timed_cli(180, "export.py", "--output_model", model, "--trust_model_code", *FAST)
    assert run.returncode == 0, run.stderr[-2000:]
    assert marker.read_text().count("imported") == 2


# ----------------------------------------------------------------------------- regular files only


def replace_file(path: Path, kind: str, outside: Path) -> Path | None:
    """Put something other than a regular file where the bundle's `path` was; what a run must
    never read (a link's target), if anything."""
    original = path.read_bytes()
    path.unlink()
    if kind == "link_outside":  # the original bytes (a matching hash), outside the folder
        outside.write_bytes(original)
        path.symlink_to(os.path.relpath(outside, path.parent))
        return untouched(outside)
    if kind == "link_inside":  # a matching copy beside it, under another name
        inside = path.with_name("copy-" + path.name)
        inside.write_bytes(original)
        path.symlink_to(inside.name)
        return untouched(inside)
    if kind == "fifo":  # whatever opens it for reading blocks until a writer comes
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
        except PermissionError:
            pytest.skip("creating a device node needs root")
    return None


WHAT = {"link_outside": "is a symbolic link to '../secret", "link_inside": "is a symbolic link",
        "fifo": "is a FIFO (named pipe)", "folder": "is a folder",
        "device": "is a character device"}
# file → the command that reads it, and its kind in the message
READERS = {
    "model.json": ("inference.py", [], "manifest"),
    "model.onnx": ("inference.py", [], "graph"),
    "model.bn.onnx": ("inference.py", ["--ttt", "true"], "graph"),
    "model.mc.onnx": ("inference.py", ["--iterative", "mc_dropout", "--iterations", "2"],
                      "graph"),
    "model.pt": ("export.py", [], "weights"),
}


@pytest.mark.parametrize("name,kind", [
    ("model.json", "link_inside"), ("model.json", "fifo"),
    ("model.onnx", "link_outside"), ("model.onnx", "link_inside"), ("model.onnx", "fifo"),
    ("model.onnx", "device"),
    ("model.bn.onnx", "link_outside"), ("model.bn.onnx", "fifo"),
    ("model.bn.onnx", "folder"),  # (a folder where the CLI writes is already --output_model's 2)
    ("model.mc.onnx", "link_inside"),
    ("model.pt", "link_outside"), ("model.pt", "link_inside"), ("model.pt", "fifo"),
])
def test_bundle_files_must_be_regular_files(digits_bundle, tmp_path, atime_moves, name, kind):
    model = copy_bundle(digits_bundle, tmp_path / "bundle")
    decoy = decoy_beside(model.parent)
    target = replace_file(model.parent / name, kind, tmp_path / "secret")
    script, args, what = READERS[name]
    flag = "--output_model" if script == "export.py" else "--model"
    run = timed_cli(30, script, flag, model, *args, *FAST)
    assert_clean_failure(run, 4, f"the bundle's {what} {model.parent / name} {WHAT[kind]}",
                         "none was opened")
    assert_never_read(atime_moves, decoy, *[target] if target else [])


@pytest.mark.parametrize("kind", ["link_inside", "link_outside", "fifo"])
def test_a_model_definition_must_be_a_regular_file_even_when_trusted(model_def_bundle, tmp_path,
                                                                     atime_moves, kind):
    model, marker = hostile_model_def(model_def_bundle, tmp_path / "bundle")
    target = replace_file(model.with_suffix(".def.py"), kind, tmp_path / "secret.py")
    run = timed_cli(60, "inference.py", "--model", model, "--ttt", "true", "--ttt_method",
                    "tent", "--trust_model_code", "true", *FAST)
    assert_clean_failure(run, 4, f"the bundle's model definition {model.with_suffix('.def.py')} "
                         f"{WHAT[kind]}")
    assert not marker.exists()
    assert_never_read(atime_moves, *[target] if target else [])


@pytest.mark.parametrize("kind", ["link_outside", "fifo"])
def test_a_tokenizer_must_be_a_regular_file(hf_bundle, tmp_path, atime_moves, kind):
    model = copy_bundle(hf_bundle, tmp_path / "bundle")
    decoy = decoy_beside(model.parent)
    tokenizer = model.with_suffix(".tokenizer.json")
    target = replace_file(tokenizer, kind, tmp_path / "secret")
    run = timed_cli(30, "inference.py", "--model", model, *FAST)
    assert_clean_failure(run, 4, f"the bundle's tokenizer {tokenizer} {WHAT[kind]}")
    assert_never_read(atime_moves, decoy, *[target] if target else [])


def with_external_data(model: Path, location: str) -> Path:
    """The bundle's graph rewritten with its weights in an external data file at `location`
    (relative to the graph), its sha256 recomputed; that file."""
    import onnx

    graph = onnx.load(str(model))
    (model.parent / location).parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(graph, str(model), save_as_external_data=True, location=location,
                    all_tensors_to_one_file=True, size_threshold=1024)
    edit_manifest(model, lambda m: m["files"]["sha256"].update(onnx=sha256(model)))
    return model.parent / location


def test_external_data_beside_the_graph_is_read(digits_bundle, tmp_path):
    model = copy_bundle(digits_bundle, tmp_path / "bundle")
    with_external_data(model, "model.weights.bin")
    run = timed_cli(60, "inference.py", "--model", model, *FAST)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("kind", ["link_inside", "fifo", "subfolder"])
def test_external_data_must_be_a_regular_file_in_the_folder(digits_bundle, tmp_path,
                                                            atime_moves, kind):
    model = copy_bundle(digits_bundle, tmp_path / "bundle")
    decoy = decoy_beside(model.parent)
    location = "data/model.weights.bin" if kind == "subfolder" else "model.weights.bin"
    data = with_external_data(model, location)
    target = untouched(data) if kind == "subfolder" else replace_file(data, kind, decoy)
    run = timed_cli(30, "inference.py", "--model", model, *FAST)
    phrase = ("reads external data from 'data/model.weights.bin', not a file directly in the "
              "bundle's folder" if kind == "subfolder"
              else f"the bundle's external data {data} {WHAT[kind]}")
    assert_clean_failure(run, 4, phrase)
    assert_never_read(atime_moves, decoy, *[target] if target else [])


def test_a_bundle_folder_reached_through_a_link_the_user_named(digits_bundle, tmp_path):
    model = copy_bundle(digits_bundle, tmp_path / "bundle")
    (tmp_path / "latest").symlink_to("bundle")
    run = timed_cli(60, "inference.py", "--model", tmp_path / "latest" / "model.onnx", *FAST)
    assert run.returncode == 0, run.stderr[-2000:]
    assert model.exists()


# ----------------------------------------------------------------------------- sizes


def sparse(path: Path, size: int) -> None:
    path.unlink()
    with open(path, "wb") as handle:
        try:
            handle.truncate(size)
        except OSError as err:  # a file system without sparse files this large
            pytest.skip(f"cannot make a {size}-byte sparse file here: {err}")


@pytest.mark.parametrize("name,limit", [
    ("model.json", "64 MiB"), ("model.onnx", "2,048 MiB"), ("model.bn.onnx", "2,048 MiB"),
    ("model.pt", "16,384 MiB"), ("model.weights.bin", "16,384 MiB"),
])
def test_a_terabyte_sparse_file_is_refused_unread(digits_bundle, tmp_path, name, limit):
    model = copy_bundle(digits_bundle, tmp_path / "bundle")
    if name == "model.weights.bin":
        with_external_data(model, name)
    sparse(model.parent / name, 1 << 40)
    script, args, what = READERS.get(name, ("inference.py", [], "external data"))
    flag = "--output_model" if script == "export.py" else "--model"
    run = timed_cli(20, script, flag, model, *args, *FAST)
    assert_clean_failure(run, 4, f"{name} is 1,099,511,627,776 bytes, over the {limit} a "
                         f"bundle's {what} may have", "it was not read")
    # a read of it would have taken the child's memory (or its time) with it
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss < 4 << 20  # KiB: 4 GiB


def test_the_size_check_reads_no_byte(digits_bundle, tmp_path, atime_moves):
    """In process: a 1 TB graph is refused without reading any of it (hashing it would take
    an hour)."""
    from ttc.serving.bundle import BundlePaths, read_manifest, require_onnx_in_bundle
    from utils import ExportError

    model = copy_bundle(digits_bundle, tmp_path / "bundle")
    sparse(model, 1 << 40)
    untouched(model)
    paths = BundlePaths.from_model_path(model)
    with pytest.raises(ExportError, match="over the 2,048 MiB"):
        require_onnx_in_bundle(paths, read_manifest(paths))
    assert_never_read(atime_moves, model)


def test_quantize_diagnose_checks_the_fp32_graph_it_compares_with(digits_bundle, tmp_path):
    """quantize.py --diagnose reads model.onnx beside the int8 graph: a FIFO there is refused
    before any data is read (it used to block the run for ever)."""
    model = copy_bundle(digits_bundle, tmp_path / "bundle")
    shutil.copy(model, model.with_suffix(".int8.onnx"))  # a stand-in int8 graph, hash recorded
    edit_manifest(model, lambda m: (m["files"].update(int8="model.int8.onnx"),
                                    m["files"]["sha256"].update(int8=sha256(model))))
    replace_file(model, "fifo", tmp_path / "unused")
    run = timed_cli(30, "quantize.py", "--output_model", model, "--diagnose", "true", *FAST)
    assert_clean_failure(run, 4, f"the bundle's graph {model} is a FIFO (named pipe)")
