"""The bundle manifest, typed: what bundle.read_manifest returns once the schema
(manifest_schema) has checked the JSON, so that the stages read attributes, not string keys.

A manifest is built and filled as a JSON dict (train, export, quantize: bundle.new_manifest and
the record_* functions) and written as JSON; `Manifest.from_dict` reads such a dict (checked, or
a draft its writer built), `to_json_dict` gives the dict back, unchanged. The older schemas'
gaps (no calibration, no extra graphs, no files, no input.padding_id, ...) read as the defaults
the stages used for them. The sections whose fields the encoders and networks take whole
(preprocessing, architecture, dataset) keep their JSON object beside their typed fields.

No torch here: inference reads bundles.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping

from ttc.inputs.preprocess import HF_TOKENIZER, PAD_ID


def _object(value: Any) -> dict:
    """A section of the manifest, or {} where an older (or a draft) manifest has none."""
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class InputSpec:
    """The graph's input: its name, shape (sizes and axis names), dtype, and for token ids their
    padding id and the extra inputs an hf graph takes (attention mask, token types)."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str | None = None
    padding_id: int | None = None
    max_length: int | None = None
    extra_inputs: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, spec: Mapping) -> "InputSpec":
        return cls(name=spec.get("name", ""), shape=tuple(spec.get("shape", ())),
                   dtype=spec.get("dtype"), padding_id=spec.get("padding_id"),
                   max_length=spec.get("max_length"),
                   extra_inputs=tuple(e["name"] for e in spec.get("extra_inputs", ())))

    @property
    def pad_id(self) -> int:
        """The padding id of a token-id input: 0 for ours (written before padding_id was), an
        hf tokenizer's own."""
        return int(PAD_ID if self.padding_id is None else self.padding_id)

    @property
    def names(self) -> list[str]:
        """Every graph input, the first one first."""
        return [self.name, *self.extra_inputs]


@dataclass(frozen=True)
class Preprocessing:
    """How inputs become the graph's input; `spec` is the JSON object the encoders, shifts and
    transforms read whole (preprocess.Tokenizer.from_manifest, TabularEncoder.from_manifest)."""

    kind: str
    tokenizer: str | None = None
    spec: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, spec: Mapping) -> "Preprocessing":
        return cls(kind=spec.get("kind", ""), tokenizer=spec.get("tokenizer"), spec=dict(spec))

    @property
    def is_hf(self) -> bool:
        """An hf arch's tokenizer: the bundle carries its tokenizer.json."""
        return self.tokenizer == HF_TOKENIZER

    @property
    def sha256(self) -> str | None:
        """An hf tokenizer.json's sha256."""
        return self.spec.get("sha256")


@dataclass(frozen=True)
class Architecture:
    """The network: its class name, its --arch (none in bundles written before --arch, which
    load as their class), its number of classes; `spec` is the JSON object build_model takes."""

    name: str
    arch: str | None = None
    num_classes: int = 0
    spec: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, spec: Mapping) -> "Architecture":
        return cls(name=spec.get("name", ""), arch=spec.get("arch"),
                   num_classes=spec.get("num_classes", 0), spec=dict(spec))

    @property
    def is_user_network(self) -> bool:
        """A --model_def network: Python code the bundle carries."""
        return self.name == "UserNetwork"

    @property
    def model_def(self) -> Any:
        """A UserNetwork's {file, factory, sha256} (as written: the schema checks its type)."""
        return self.spec.get("model_def")


@dataclass(frozen=True)
class Calibration:
    """The temperature fit every exported graph bakes in (calibrate.TemperatureFit); `entry`
    is the manifest's JSON object, as the report shows it. `temperature` is the T the graphs
    bake, `fitted_temperature` the fitted one; they differ where the fit was not applied (no
    evidence for it, docs/calibration.md: `temperature` is then 1). A bundle from before that
    decision has neither `applied` nor `rule` (or has them null): its T was applied whenever it
    is not 1, by the rule of the time, "always"."""

    temperature: float
    method: str
    applied: bool = False
    fitted_temperature: float | None = None
    rule: str | None = None
    entry: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, entry: Mapping) -> "Calibration":
        temperature, method = float(entry.get("temperature", 1.0)), entry.get("method", "none")
        fitted, applied = entry.get("fitted_temperature"), entry.get("applied")
        if fitted is None and method != "none":
            fitted = temperature
        return cls(temperature=temperature, method=method,
                   applied=(method != "none" and temperature != 1.0) if applied is None
                   else applied,
                   fitted_temperature=None if fitted is None else float(fitted),
                   rule=entry.get("rule") or ("always" if method != "none" else None),
                   entry=dict(entry))

    def report_entry(self) -> dict:
        """The entry with the decision's keys an older bundle lacks filled in as read."""
        return {**self.entry, "applied": self.applied,
                "fitted_temperature": self.fitted_temperature, "rule": self.rule}


@dataclass(frozen=True)
class Variant:
    """What quantize.py recorded of a variant graph (int8 "quantization", "fp16"); an empty
    record reads as none, as the stages have always read it. `reduce_range`: int8 with 7-bit
    weights (a record from before --int8_range reads as full range, what was written then)."""

    mode: str | None = None
    verdict: str | None = None
    used_for_inference: bool | None = None
    reduce_range: bool = False

    @classmethod
    def from_dict(cls, entry: Any) -> "Variant | None":
        if not isinstance(entry, dict) or not entry:
            return None
        return cls(mode=entry.get("mode"), verdict=entry.get("verdict"),
                   used_for_inference=entry.get("used_for_inference"),
                   reduce_range=bool(entry.get("reduce_range")))


COMPRESSED_VARIANTS = ("pruned", "qat", "pruned_qat")  # in the order training makes them


@dataclass(frozen=True)
class CompressedVariant:
    """A compressed network (--prune, --qat): how to rebuild it from the manifest's architecture
    (its parameter shapes, whether it is fake-quantized, its weights file) and, once judged,
    the gate's verdict."""

    name: str
    quantized: bool = False
    shapes: Mapping[str, tuple[int, ...]] | None = None
    weights: str | None = None
    verdict: str | None = None
    used_for_inference: bool | None = None  # passed the gate
    speedup: float | None = None  # fp32's latency / its own, at the judged batch size
    entry: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, entry: Mapping) -> "CompressedVariant":
        shapes = entry.get("shapes")
        return cls(name=entry["name"], quantized=bool(entry.get("quantized")),
                   shapes=None if shapes is None else {k: tuple(v) for k, v in shapes.items()},
                   weights=entry.get("weights"), verdict=entry.get("verdict"),
                   used_for_inference=entry.get("used_for_inference"),
                   speedup=entry.get("speedup"), entry=dict(entry))

    def as_variant(self) -> Variant:
        return Variant(mode=self.name, verdict=self.verdict,
                       used_for_inference=self.used_for_inference)


@dataclass(frozen=True)
class Compression:
    """The manifest's compression record: the variants training made and the graph the gate
    chose to serve ("onnx", "int8" or a variant's name; None before it judged)."""

    variants: tuple[CompressedVariant, ...] = ()
    served: str | None = None

    @classmethod
    def from_dict(cls, entry: Any) -> "Compression | None":
        if not isinstance(entry, dict):
            return None
        return cls(variants=tuple(CompressedVariant.from_dict(v)
                                  for v in entry.get("variants") or ()),
                   served=entry.get("served"))

    def get(self, name: str) -> CompressedVariant | None:
        return next((v for v in self.variants if v.name == name), None)


@dataclass(frozen=True)
class ExtraGraph:
    """A graph besides model.onnx (bn, mc, ensemble, tta): its file, its averages' temperature,
    (MC-dropout) the number of passes that temperature was fitted with, (an ensemble) its
    members, and (a segmenter's TTA) its views."""

    file: str | None = None
    temperature: float | None = None
    members: int | None = None
    fitted_passes: int | None = None
    views: str | None = None  # a segmenter's TTA graph: its views (segment/views.py)

    @classmethod
    def from_dict(cls, entry: Any) -> "ExtraGraph | None":
        if not isinstance(entry, dict):
            return None
        return cls(file=entry.get("file"), temperature=entry.get("temperature"),
                   members=entry.get("members"),
                   fitted_passes=_object(entry.get("temperature_fit")).get("passes"),
                   views=entry.get("views"))


@dataclass(frozen=True)
class ExtraGraphs:
    """The extra graphs a bundle describes. `listed`: whether the manifest has the section at
    all (bundles exported before it existed lack it, and so say nothing of a missing graph)."""

    bn: ExtraGraph | None = None
    mc: ExtraGraph | None = None
    ensemble: ExtraGraph | None = None
    tta: ExtraGraph | None = None  # a segmenter's views and their merge, in one graph
    listed: bool = False

    @classmethod
    def from_dict(cls, graphs: Any) -> "ExtraGraphs":
        listed = isinstance(graphs, dict)
        graphs = _object(graphs)
        return cls(**{key: ExtraGraph.from_dict(graphs.get(key))
                      for key in ("bn", "mc", "ensemble", "tta")}, listed=listed)


@dataclass(frozen=True)
class BundleFiles:
    """The bundle's file names by key (onnx, weights, int8, model_def, tokenizer, ...: bare
    names, null before the file is written) and their sha256 by key."""

    names: Mapping[str, str | None] = field(default_factory=dict)
    sha256: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, files: Any) -> "BundleFiles":
        files = _object(files)
        return cls(names={k: v for k, v in files.items() if k != "sha256"},
                   sha256=dict(_object(files.get("sha256"))))

    def __contains__(self, key: str) -> bool:
        """Whether the manifest lists `key` (even as not yet written)."""
        return key in self.names

    def name(self, key: str) -> str | None:
        return self.names.get(key)

    def digest(self, key: str) -> str | None:
        return self.sha256.get(key)


@dataclass(frozen=True)
class RecordedColumns:
    """The table columns training read, by their resolved names (bundles from before names were
    recorded have none)."""

    label: str | None
    inputs: tuple[str, ...]

    @classmethod
    def from_dict(cls, columns: Any) -> "RecordedColumns | None":
        if not columns:
            return None
        return cls(label=columns["label"], inputs=tuple(columns["inputs"]))


@dataclass(frozen=True)
class DatasetRecord:
    """Where the data came from and how it was split; `fields` is the JSON object
    data.DataOptions.from_manifest reads whole."""

    model_type: str | None = None
    train_class_counts: tuple[int, ...] | None = None
    has_header: str | None = None
    label_column: str | None = None
    columns: RecordedColumns | None = None
    fields: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, record: Any) -> "DatasetRecord":
        record = _object(record)
        counts = record.get("train_class_counts")
        return cls(model_type=record.get("model_type"),
                   train_class_counts=None if counts is None else tuple(counts),
                   has_header=record.get("has_header"), label_column=record.get("label_column"),
                   columns=RecordedColumns.from_dict(record.get("columns")), fields=dict(record))

    def flag(self, name: str) -> Any:
        """A reading flag as training was given it ("text_column", "feature_columns", ...:
        what bundles from before the column names were recorded tell)."""
        return self.fields.get(name)


@dataclass(frozen=True)
class Manifest:
    """A bundle's model.json, typed. `Manifest.from_dict` takes a schema-checked manifest (or a
    draft its writer built); `to_json_dict` gives the JSON dict back as it was read."""

    model_type: str
    labels: tuple[str, ...]
    input: InputSpec
    output_names: tuple[str, ...]
    preprocessing: Preprocessing
    architecture: Architecture
    dataset: DatasetRecord
    calibration: Calibration | None = None
    quantization: Variant | None = None
    fp16: Variant | None = None
    compression: Compression | None = None
    extra_graphs: ExtraGraphs = field(default_factory=ExtraGraphs)
    files: BundleFiles = field(default_factory=BundleFiles)
    created: str | None = None
    _json: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, manifest: Mapping) -> "Manifest":
        """The typed manifest of a JSON dict (copied: the dict may be filled on afterwards)."""
        raw = copy.deepcopy(dict(manifest))
        calibration = raw.get("calibration")
        return cls(model_type=raw.get("model_type", ""), labels=tuple(raw.get("labels", ())),
                   input=InputSpec.from_dict(_object(raw.get("input"))),
                   output_names=tuple(o["name"] for o in raw.get("outputs", ())),
                   preprocessing=Preprocessing.from_dict(_object(raw.get("preprocessing"))),
                   architecture=Architecture.from_dict(_object(raw.get("architecture"))),
                   dataset=DatasetRecord.from_dict(raw.get("dataset")),
                   calibration=(Calibration.from_dict(calibration)
                                if isinstance(calibration, dict) else None),
                   quantization=Variant.from_dict(raw.get("quantization")),
                   fp16=Variant.from_dict(raw.get("fp16")),
                   compression=Compression.from_dict(raw.get("compression")),
                   extra_graphs=ExtraGraphs.from_dict(raw.get("extra_graphs")),
                   files=BundleFiles.from_dict(raw.get("files")), created=raw.get("created"),
                   _json=raw)

    def to_json_dict(self) -> dict:
        """The manifest's JSON dict as read (a copy, for a writer to fill on and write)."""
        return copy.deepcopy(self._json)

    def contract_json(self) -> list:
        """The JSON of what a graph's numbers mean (bundle.contract_digest): its labels, input
        and preprocessing, as written."""
        return [self._json["labels"], self._json["input"], self._json["preprocessing"]]

    @property
    def temperature(self) -> float:
        """The temperature a bundle's graphs divide the logits by (1 for a bundle written before
        calibration, or with --calibrate none)."""
        return self.calibration.temperature if self.calibration else 1.0

    @property
    def classes(self) -> int:
        return len(self.labels)

    def variant(self, key: str) -> Variant | None:
        """What quantize.py recorded of "int8" or "fp16", or the gate of a compressed variant."""
        if key in COMPRESSED_VARIANTS:
            compressed = self.compression.get(key) if self.compression else None
            return compressed.as_variant() if compressed else None
        return self.quantization if key == "int8" else self.fp16 if key == "fp16" else None

    def full_range_int8(self, key: str) -> bool:
        """Whether the graph `key` has full-range (8-bit) int8 weights, which can saturate on
        x86 CPUs without VNNI or AMX (runtime.saturates): int8 quantized without reduce_range
        (as every int8 from before --int8_range was) and the quantization-aware variants
        (ttc/compress/qat.py trains weights over the whole int8 range)."""
        if key == "int8":
            return not (self.quantization and self.quantization.reduce_range)
        compressed = (self.compression.get(key) if self.compression and key in
                      COMPRESSED_VARIANTS else None)
        return bool(compressed and compressed.quantized)


def as_manifest(manifest: "Manifest | Mapping") -> Manifest:
    """A typed manifest of a typed one (itself) or of a JSON dict (a draft or a test's)."""
    return manifest if isinstance(manifest, Manifest) else Manifest.from_dict(manifest)
