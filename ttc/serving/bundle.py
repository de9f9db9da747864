"""The model bundle: its files (model.onnx, model.json, model.pt and the extra graphs, all named
after --output_model) and its manifest's schema — built by training, filled by export and
quantization, validated before anything in it is used, and read by every later stage.

No torch here: inference reads bundles.
"""
from __future__ import annotations

import datetime
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from ttc.inputs.limits import graph_size_problem
# The typed manifest lives in manifest.py; the other packages import it from here.
from ttc.serving.manifest import InputSpec, Manifest, as_manifest
from ttc.tasks.registry import task_for, task_of_kind
from ttc.serving.manifest_schema import MAX_DEPTH, agreement_problem, manifest_problem
from ttc.inputs.preprocess import PADDING_ID_KEY, register_hf_tokenizer
from utils import ConfigError, ExportError, nesting_depth, quoted, sha256_of, staged_files

BUNDLE_FORMAT = "ttc-model-bundle"
BUNDLE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class BundlePaths:
    """The files of one model bundle, all sharing the stem of `--output_model`."""

    onnx: Path
    manifest: Path
    weights: Path

    @classmethod
    def from_model_path(cls, model_path: str | Path) -> "BundlePaths":
        onnx_path = Path(model_path)
        if onnx_path.suffix != ".onnx":
            onnx_path = onnx_path.with_suffix(".onnx")
        return cls(onnx=onnx_path, manifest=onnx_path.with_suffix(".json"),
                   weights=onnx_path.with_suffix(".pt"))

    @property
    def int8(self) -> Path:
        return self.onnx.with_suffix(".int8.onnx")

    @property
    def fp16(self) -> Path:
        return self.onnx.with_suffix(".fp16.onnx")

    @property
    def bn(self) -> Path:
        """The graph with its BatchNorm nodes kept, for test-time adaptation."""
        return self.onnx.with_suffix(".bn.onnx")

    @property
    def model_def(self) -> Path:
        """The copy of a --model_def network's Python file."""
        return self.onnx.with_suffix(".def.py")

    @property
    def tokenizer(self) -> Path:
        """An hf arch's tokenizer (Hugging Face tokenizers' JSON format)."""
        return self.onnx.with_suffix(".tokenizer.json")

    def side_file(self, key: str) -> Path:
        """A file the manifest's network or preprocessing needs: "model_def", "tokenizer"."""
        return {"model_def": self.model_def, "tokenizer": self.tokenizer}[key]

    GRAPH_KEYS = ("onnx", "int8", "fp16", "bn", "mc", "ensemble", "tta", "pruned", "qat",
                  "pruned_qat")

    def files(self) -> dict[str, Path]:
        """Every file a bundle may hold, by what it is."""
        return {"manifest": self.manifest, "weights": self.weights,
                **{f"{key} weights": self.variant_weights(key)
                   for key in ("pruned", "qat", "pruned_qat")},
                "model definition": self.model_def, "tokenizer": self.tokenizer,
                **{f"{key} graph" if key != "onnx" else "graph": self.variant(key)
                   for key in self.GRAPH_KEYS}}

    def variant_weights(self, key: str) -> Path:
        """A compressed variant's weights ("pruned", "qat", "pruned_qat"): model.<key>.pt."""
        return self.onnx.with_suffix(f".{key}.pt")

    def variant(self, key: str) -> Path:
        """The graph file of a variant: "onnx" (fp32), "int8", "fp16", or of an extra graph:
        "bn" (BatchNorm adaptation), "mc" (MC-dropout), "ensemble", "tta" (a segmenter's TTA)."""
        if key == "onnx":
            return self.onnx
        return self.onnx.with_suffix(f".{key}.onnx")


MiB, GiB = 1 << 20, 1 << 30
# The largest file of each kind the tool opens in a bundle, whatever its manifest says (a
# manifest is written by whoever made the bundle): checked before the file is opened, so that a
# 1 TB sparse file is refused at once instead of hashed for an hour. An ONNX graph is a
# protobuf, which cannot pass 2 GiB (larger models keep their weights in external data).
FILE_SIZE_LIMITS = {"manifest": 64 * MiB, "tokenizer": 256 * MiB, "model definition": 16 * MiB,
                    "graph": 2 * GiB, "weights": 16 * GiB, "external data": 16 * GiB}
FILE_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"),
              (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
              (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def bundle_file(path: Path, kind: str) -> os.stat_result | None:
    """The lstat of a file the tool is about to read from a bundle (`kind`: a key of
    FILE_SIZE_LIMITS), None when there is none. Checked before anything opens it: the file must
    be a regular file in the bundle's folder (the folder may be reached through a link the user
    named; the files in it may not be links, even to a file beside them) and within its kind's
    size limit; anything else is an ExportError (exit 4)."""
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        raise ExportError(f"the bundle's {kind} {path} cannot be read ({err.strerror or err})",
                          "check the bundle folder's permissions") from None
    what = next((name for test, name in FILE_KINDS if test(info.st_mode)),
                None if stat.S_ISREG(info.st_mode) else "not a regular file")
    if what is not None:
        target = f" to {quoted(os.readlink(path), 60)}" if stat.S_ISLNK(info.st_mode) else ""
        raise ExportError(f"the bundle's {kind} {path} is {what}{target}, not a regular file: "
                          "a bundle's files must be plain files in its folder, and none was "
                          "opened", "replace it with the file itself (a copy, not a link), or "
                          "re-create the bundle with pipeline.py")
    limit = FILE_SIZE_LIMITS[kind]
    if info.st_size > limit:
        raise ExportError(f"the bundle's {kind} {path} is {info.st_size:,} bytes, over the "
                          f"{limit // MiB:,} MiB a bundle's {kind} may have; it was not read",
                          "this is not a file the tool wrote: re-create the bundle with "
                          "pipeline.py")
    return info


def read_manifest(paths: BundlePaths) -> Manifest:
    """Load and sanity-check a bundle manifest, typed; any problem is an ExportError (exit 4)."""
    if bundle_file(paths.manifest, "manifest") is None:
        raise ExportError(f"bundle manifest {paths.manifest} not found",
                          "train first (pipeline.py or train.py) with --output_model "
                          f"{paths.onnx}")
    try:
        manifest = json.loads(paths.manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ExportError(f"bundle manifest {paths.manifest} is not valid JSON ({err})",
                          "re-create the bundle with pipeline.py") from None
    except RecursionError:  # nested deeper than the parser goes
        manifest = None
    if manifest is None or nesting_depth(manifest) > MAX_DEPTH:
        raise ExportError(f"{paths.manifest} is JSON nested deeper than {MAX_DEPTH} levels, "
                          "which no bundle manifest is", "re-create the bundle with pipeline.py")
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        raise ExportError(f"{paths.manifest} is not a model bundle manifest",
                          "pass the .onnx written by pipeline.py or export.py")
    if manifest.get("format_version") != BUNDLE_FORMAT_VERSION:
        raise ExportError(f"{paths.manifest} has format version "
                          f"{str(manifest.get('format_version'))[:20]}, this tool reads version "
                          f"{BUNDLE_FORMAT_VERSION}",
                          "re-create the bundle with this version of the tool")
    problem = manifest_problem(manifest)
    if problem is None and (problem := agreement_problem(manifest)) and \
            (manifest.get("files") or {}).get("onnx"):
        # an edited manifest: the graph's check says how
        require_onnx_in_bundle(paths, Manifest.from_dict(manifest))
    if problem:
        raise ExportError(f"{paths.manifest} is not a valid manifest: {problem}",
                          "re-create the bundle with pipeline.py")
    typed = Manifest.from_dict(manifest)
    register_tokenizer_file(typed, paths)
    return typed


def register_tokenizer_file(manifest: Manifest, paths: BundlePaths) -> None:
    """An hf bundle's tokenizer.json, checked against the manifest's sha256 and registered for
    preprocess.HFTokenizer."""
    if not manifest.preprocessing.is_hf:
        return
    name = manifest.files.name("tokenizer")
    path = paths.manifest.parent / name if name else paths.tokenizer
    try:
        if bundle_file(path, "tokenizer") is None:
            raise FileNotFoundError(2, "No such file or directory")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ExportError(f"the bundle's tokenizer {path} cannot be read ({err.strerror or err})",
                          "keep the .tokenizer.json written with the bundle next to its "
                          "model.json") from None
    register_hf_tokenizer(text, manifest.preprocessing.sha256, str(path))


TRUST_HINT = "pass --trust_model_code true if you trust whoever made this bundle"


def require_trusted_model_code(manifest: Manifest, paths: BundlePaths, trusted: bool) -> None:
    """A --model_def bundle's network is a Python file of the bundle: rebuilding it (export.py,
    Tent) imports that file, which runs whatever code it holds. Refused with a ConfigError
    (exit 2), before anything else is read or run, unless the user trusts the bundle
    (--trust_model_code true, or the user's own --model_def trained in this process)."""
    if not manifest.architecture.is_user_network or trusted:
        return
    model_def = manifest.architecture.model_def
    if not isinstance(model_def, dict):
        raise ExportError(f"{paths.manifest} is not a valid manifest: architecture.model_def "
                          "must name the network's file and factory",
                          "re-create the bundle with pipeline.py --model_def")
    name = manifest.files.name("model_def") or paths.model_def.name
    factory = model_def.get("factory")
    call = (f"{factory}()" if isinstance(factory, str) and factory.isidentifier()
            and len(factory) <= 60 else f"factory {quoted(factory, 60)}")
    raise ConfigError(f"this bundle's network is Python code: rebuilding it would import "
                      f"{paths.manifest.parent / name} and call its {call}, running whatever "
                      "that file holds; nothing was imported", TRUST_HINT)


def require_onnx_in_bundle(paths: BundlePaths, manifest: Manifest, variant: str = "onnx"
                           ) -> Path:
    """The graph file of `variant` ("onnx" fp32, or "int8"), refused if missing or from another
    run than its manifest."""
    expected = manifest.files.digest(variant)
    path = paths.variant(variant)
    fix = {"onnx": f"python export.py --output_model {paths.onnx}",
           "int8": f"python quantize.py --output_model {paths.onnx} --quantize auto",
           "fp16": f"python quantize.py --output_model {paths.onnx} --fp16 true",
           "bn": f"python export.py --output_model {paths.onnx}",
           "mc": f"python export.py --output_model {paths.onnx}",
           "ensemble": f"python pipeline.py ... --ensemble_size N --output_model {paths.onnx}",
           "tta": f"python export.py --output_model {paths.onnx} --tta true",
           **{key: f"python pipeline.py ... --prune RATIO --qat true --output_model {paths.onnx}"
              for key in ("pruned", "qat", "pruned_qat")}}[variant]
    if not manifest.files.name(variant) or not expected:
        what = {"onnx": "exported ONNX graph", "int8": "int8 graph", "fp16": "fp16 graph",
                "bn": "BatchNorm adaptation graph (bundles exported before test-time training "
                      "existed lack it)",
                "mc": "MC-dropout graph (a model without dropout, or a bundle exported before "
                      "MC-dropout existed, has none)",
                "ensemble": "ensemble graph (train one with --ensemble_size N)",
                "tta": "TTA graph (a segmenter's or a detector's: export one with --tta true)",
                "pruned": "pruned graph (train one with --prune RATIO)",
                "qat": "quantization-aware int8 graph (train one with --qat true)",
                "pruned_qat": "pruned int8 graph (train one with --prune RATIO --qat true)"
                }[variant]
        raise ExportError(f"bundle {paths.manifest} has no {what} yet", f"run: {fix}")
    info = bundle_file(path, "graph")  # a link, a FIFO or a 1 TB file: refused unread
    if info is None:
        raise ExportError(f"model file {path} not found", f"run: {fix}")
    checked = (str(path.resolve()), expected, info.st_size, info.st_mtime_ns,
               contract_digest(manifest))
    if checked in _VERIFIED:  # a run asks again for a graph it already checked: skip the I/O
        return path
    if sha256_of(path) != expected:
        raise ExportError(f"{path} does not match its manifest {paths.manifest.name} "
                          "(sha256 differs: the files come from different runs or were modified)",
                          f"re-run: {fix}")
    model = _parsed_graph(path)
    if model is None:
        raise ExportError(f"cannot load {path}: it is not an ONNX model (a truncated file, or "
                          "a file of another kind)", f"re-run: {fix}")
    problem = external_data_problem(model, path)
    if problem:
        raise ExportError(f"{path} refused: {problem}",
                          "keep a model's external data files in its own folder")
    problem = contract_problem(model, manifest)
    if problem:
        raise ExportError(f"{paths.manifest} does not match the graph {path.name}: {problem} "
                          "(the manifest was edited, or comes from another run)",
                          "restore the manifest written with the graph, or re-create the "
                          "bundle with pipeline.py")
    problem = graph_size_problem(model)  # before ONNX Runtime folds or allocates it
    if problem:
        raise ExportError(f"{path} refused: {problem}", "a graph this tool exports fixes no "
                          "tensor that large; raise --max_runtime_memory_mb only for a bundle "
                          "you trust")
    _VERIFIED.add(checked)
    return path


# Graphs this process has verified, keyed by file identity, expected hash and manifest contract:
# inference checks the graph before reading data and again when it opens the session.
_VERIFIED: set[tuple] = set()


def _parsed_graph(path: Path) -> Any:
    import onnx

    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - any parse failure: not a graph we can inspect
        return None


CONTRACT_KEY = "bundle.contract_sha256"  # graph metadata: what the graph was exported for


def contract_digest(manifest: Manifest | Mapping) -> str:
    """A fingerprint of what a graph's numbers mean: its labels, input and preprocessing (of a
    typed manifest, or of its JSON dict)."""
    import hashlib

    contract = manifest.contract_json() if isinstance(manifest, Manifest) else [
        manifest["labels"], manifest["input"], manifest["preprocessing"]]  # the JSON dict's
    text = json.dumps(contract, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def mark_padding_id(model: Any, input_spec: InputSpec) -> Any:
    """An hf graph records its padding id in its metadata: whoever runs it (runtime.graph_feeder,
    and the graphs derived from it) builds the attention mask by it."""
    if input_spec.extra_inputs:
        set_metadata(model, PADDING_ID_KEY, str(input_spec.padding_id))
    return model


def set_metadata(model: Any, key: str, value: str) -> None:
    """Set one metadata_props entry of a graph, replacing any earlier value."""
    kept = [p for p in model.metadata_props if p.key != key]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    entry = model.metadata_props.add()
    entry.key, entry.value = key, value


def stamp_contract(model: Any, manifest: Manifest | Mapping) -> Any:
    """Record the manifest's contract_digest in a graph's metadata (export and quantize do, so
    an edited manifest is caught before ONNX Runtime fails on it, or worse, does not)."""
    manifest = as_manifest(manifest)
    set_metadata(model, CONTRACT_KEY, contract_digest(manifest))
    return mark_padding_id(model, manifest.input)


def contract_problem(model: Any, manifest: Manifest) -> str | None:
    """What in the manifest contradicts the graph: its input name or shape, its number of
    classes, or (graphs stamped at export) any edit of labels, input or preprocessing."""
    inputs = {i.name: _static_dims(i) for i in model.graph.input}
    spec = manifest.input
    if spec.name not in inputs:
        return f"the graph has no input {spec.name!r} (its inputs: {sorted(inputs)})"
    expected = _expected_input_dims(manifest)
    actual = inputs[spec.name][1:]
    for position, (want, have) in enumerate(zip(expected, actual), start=1):
        if want is not None and have is not None and want != have:
            return (f"input {spec.name!r} dimension {position} is {have} in the graph and "
                    f"{want} by the manifest's preprocessing")
    # the class axis: last of a classifier's (batch, classes), second of a segmenter's planes
    class_axis = {2: -1, 4: 1}
    classes = {o.name: dims[class_axis[len(dims)]] for o in model.graph.output
               if o.name in ("logits", "probabilities")
               and len(dims := _static_dims(o)) in class_axis}
    for name, count in classes.items():
        if count is not None and count != manifest.classes:
            return (f"the graph's {name} has {count} classes and the manifest "
                    f"{manifest.classes} labels")
    metadata = {p.key: p.value for p in model.metadata_props}
    padding = metadata.get(PADDING_ID_KEY)
    if padding is not None and padding != str(spec.pad_id):
        return (f"its metadata's {PADDING_ID_KEY} {quoted(padding)} is not the input's padding id "
                f"{spec.pad_id}")
    stamped = metadata.get(CONTRACT_KEY)
    if stamped and stamped != contract_digest(manifest):
        return "its labels, input or preprocessing differ from those the graph was exported for"
    return None


def _static_dims(value_info: Any) -> list[int | None]:
    dims = value_info.type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else None for d in dims]


def _expected_input_dims(manifest: Manifest) -> list[int | None]:
    """The input's dimensions after the batch, as the manifest's preprocessing implies."""
    task = task_of_kind(manifest.preprocessing.kind)
    return task.fixed_input_dims(manifest.preprocessing.spec)


def external_data_problem(model: Any, path: Path) -> str | None:
    """Why an ONNX file's external data is unsafe to load (a location outside its folder, so
    a crafted model could read any file, or in a subfolder), or None; an external data file
    that is a link, a FIFO or too large is refused here too (bundle_file), before it is read."""
    import onnx

    folder = path.parent.resolve()
    for tensor in _model_tensors(model):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        if not (folder / location).resolve().is_relative_to(folder):
            return f"tensor {tensor.name!r} reads external data from {location!r}, outside {folder}"
        if Path(location).name != location:
            return (f"tensor {quoted(tensor.name, 40)} reads external data from "
                    f"{quoted(location, 60)}, not a file directly in the bundle's folder")
        bundle_file(path.parent / location, "external data")  # a link or a FIFO: refused
    return None


def _model_tensors(model: Any) -> Iterator[Any]:
    """Every tensor an ONNX model holds: its graph's and subgraphs', and those in the nodes of
    its model-local functions (which onnx.load reads external data for too)."""
    yield from _all_tensors(model.graph)
    for function in model.functions:
        yield from _node_tensors(function.node)


def _all_tensors(graph: Any) -> Iterator[Any]:
    yield from graph.initializer
    yield from _sparse_parts(graph.sparse_initializer)
    yield from _node_tensors(graph.node)


def _node_tensors(nodes: Any) -> Iterator[Any]:
    for node in nodes:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            yield from _sparse_parts(([attribute.sparse_tensor] if attribute.HasField(
                "sparse_tensor") else []) + list(attribute.sparse_tensors))
            for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                yield from _all_tensors(sub)


def _sparse_parts(sparse_tensors: Any) -> Iterator[Any]:
    """The values and indices of sparse tensors: dense tensors, which may be external too."""
    for sparse in sparse_tensors:
        yield sparse.values
        yield sparse.indices


# ----------------------------------------------------------------------------- building


def new_manifest(*, model_type: str, labels: list[str], input_spec: dict, preprocessing: dict,
                 architecture: dict, dataset: dict, training: dict,
                 calibration: dict | None = None) -> dict:
    """A manifest as training knows it, `exported` false; export (record_export) adds the
    graphs and their hashes and sets it true, quantization (record_variant) its variants.
    `calibration`: the temperature fit (calibrate.TemperatureFit.manifest_entry), which every
    exported graph bakes in."""
    outputs = task_for(model_type).graph_outputs(len(labels))
    return {"format": BUNDLE_FORMAT, "format_version": BUNDLE_FORMAT_VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model_type": model_type, "labels": labels, "input": input_spec, "outputs": outputs,
            "preprocessing": preprocessing, "architecture": architecture, "dataset": dataset,
            "training": training, "calibration": calibration, "exported": False, "export": None,
            "quantization": None, "extra_graphs": {},
            "files": {"onnx": None, "weights": None, "sha256": {}}}


def manifest_text(manifest: dict) -> str:
    return json.dumps(manifest, indent=2) + "\n"


def record_weights(manifest: dict, paths: BundlePaths, digest: str) -> None:
    manifest["files"].update(weights=paths.weights.name, sha256={"weights": digest})


def record_side_file(manifest: dict, paths: BundlePaths, key: str, digest: str) -> None:
    manifest["files"][key] = paths.side_file(key).name
    manifest["files"]["sha256"][key] = digest


def record_export(manifest: dict, paths: BundlePaths, export: dict, extras: dict[str, dict],
                  hashes: dict[str, str]) -> None:
    """The export figures, and every graph file with its sha256 (`extras`: the extra graphs'
    manifest entries by key: bn, mc, ensemble)."""
    manifest["exported"], manifest["export"] = True, export
    manifest["files"] = {"onnx": paths.onnx.name, "weights": paths.weights.name,
                         "sha256": {"onnx": hashes["onnx"], "weights": hashes["weights"]}}
    for key in ("model_def", "tokenizer"):
        if key in hashes:
            record_side_file(manifest, paths, key, hashes[key])
    manifest["extra_graphs"] = {}
    for key, info in extras.items():
        manifest["files"][key] = paths.variant(key).name
        manifest["files"]["sha256"][key] = hashes[key]
        manifest["extra_graphs"][key] = {"file": paths.variant(key).name, **info}


def write_manifest_section(paths: BundlePaths, typed: Manifest, key: str, section: dict) -> None:
    """Replace one top-level section of the manifest ("compression": the gate's verdicts),
    atomically; the graphs it names stay as they are."""
    manifest = typed.to_json_dict()
    manifest[key] = section
    with staged_files() as stage:
        stage(paths.manifest, lambda tmp: tmp.write_text(manifest_text(manifest),
                                                          encoding="utf-8"))


def record_variant(paths: BundlePaths, typed: Manifest, key: str, data: bytes,
                   section: dict) -> None:
    """Write a variant graph ("int8", "fp16") and the manifest that names it by hash, staged
    together (graph first, manifest last)."""
    import onnx

    manifest = typed.to_json_dict()
    data = stamp_contract(onnx.load_model_from_string(data), typed).SerializeToString()
    with staged_files() as stage:
        digest = sha256_of(stage(paths.variant(key), lambda tmp: tmp.write_bytes(data)))
        manifest["quantization" if key == "int8" else key] = section
        manifest["files"][key] = paths.variant(key).name
        manifest["files"]["sha256"][key] = digest
        stage(paths.manifest, lambda tmp: tmp.write_text(manifest_text(manifest),
                                                          encoding="utf-8"))
