"""The shape of one model type's entry: plain data, no torch."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Parts:
    """The code that does a model type's work, as "module:name" references: resolved when a
    stage first asks for one (Task.part), so the entries import none of it and a new type's
    code may sit in its own folder beside its entry. A wrong reference raises there, loudly,
    and tests/test_layout.py resolves every one."""

    reader: str  # (DataOptions, *, preprocessing, labels, splits) -> Dataset: find, split, encode
    rows: str  # (preprocessing record) -> the encoder of `--input` rows into model inputs
    networks: str  # {--arch: (preprocessing, num_classes) -> the manifest's architecture record}
    modules: str  # {the architecture record's name: the nn.Module class it builds}
    # (Tally, labels, train_class_counts, split) -> the report's `evaluation`; a classifier's
    evaluation: str = "ttc.reporting.evaluation:evaluation_section"
    # (TrainingOptions, Dataset) -> ttc.nets.training.TrainedModel: the training stage; a
    # classifier's
    trainer: str = "ttc.nets.training:train_classifier"
    # (the opened bundle) -> what serve.py and the Predictor answer for a row (predict_parts,
    # answers, the V2 outputs, the tool's description: ttc/online/served.py says the shape); a
    # classifier's: labels and probabilities
    served: str = "ttc.online.served:ClassifierServing"
    # (ttc.options.stages.FlagCheckOptions) -> None: the type's own checks of its flags, before
    # any work (exit 2; config.Config.validate_tta); the classifiers have none beyond the shared
    flag_checks: str = "ttc.tasks.base:no_flag_checks"
    # (net, validation Split, preprocessing, batch_size, seed) -> (logits, classes): what
    # --calibrate temperature fits T on; a classifier's: one row per sample
    validation_scores: str = "ttc.training.stage:validation_logits"
    # (ttc.convert.writing.ExportJob) -> ExportResult: traces, checks and writes the bundle's
    # graphs (export_bundle prepares the job); a classifier's
    exporter: str = "ttc.convert.bundle:export_classifier_bundle"
    # what int8 and fp16 ask of it (ttc/compress/quantizing.py says the shape): calibration_batch,
    # scorer(manifest) -> what a variant is judged by, kept_float(graph) -> nodes kept float or
    # None; a classifier's: accuracy, 32 samples a batch, none kept float
    quantizing: str = "ttc.compress.quantizing:QUANTIZING"
    # (ttc.serving.stages.SplitRun) -> None: inference on the test split, its report sections
    # (inference, evaluation, the test-time methods'); a classifier's
    test_split: str = "ttc.online.evaluate:evaluate_classifier"
    # (ttc.serving.stages.InputRun) -> None: --input's predictions, here or on Ray; a classifier's
    new_input: str = "ttc.online.predict:predict_rows"
    # a ttc.reporting.classifier_report.ClassifierReport: what its report shows (summary rows,
    # page sections, evaluation labels, plots), which ttc/reporting asks; a classifier's
    report: str = "ttc.reporting.classifier_report:REPORT"

@dataclass(frozen=True)
class Regularisation:
    """A network's regularisation defaults (docs/networks.md says where each comes from);
    --dropout, --weight_decay, --label_smoothing and --max_norm override them."""

    dropout: float | None  # None: not ours to set (torchvision's, a checkpoint's, your module's)
    weight_decay: float  # AdamW's, decoupled
    label_smoothing: float = 0.0
    max_norm: float | None = None  # bound on the L2 norm of each row of the output layer's
    # weights, restored after every step (Kim 2014); None: no bound
    source: str = ""  # where the values come from, for the docs and the summary


def no_flag_checks(options: Any) -> None:
    """Parts.flag_checks of a type with no flag checks of its own (the classifiers')."""


def resolve(reference: str) -> Any:
    """The object a "module:name" reference names (ImportError/AttributeError when none)."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Task:
    """One model type. The stages read it instead of testing the type's name. It also knows its
    preprocessing record (the manifest's `preprocessing`, plain data): what graph input that
    record implies, and which of its sizes the report and a --model_def factory are given; and
    where the code that does its work lives (`parts`: data reader, row encoder, networks and
    their modules, evaluation), which the stages look up through `part`."""

    name: str  # --model_type, the manifest's model_type
    kind: str  # the manifest's preprocessing.kind
    archs: tuple[str, ...]  # --arch names, the default first (its `networks` builds each)
    parts: Parts
    # each --arch's regularisation defaults ("hf": every hf:NAME network's)
    regularisation: dict[str, Regularisation] = field(default_factory=dict)
    default_tta: str = ""  # --tta_transforms when none are given (ttc/testtime/tta.py's names)
    builtins: tuple[str, ...] = ()  # builtin: data sets of this type
    input_role: str = "feature"  # what its table inputs are: "image", "text" or "feature" columns
    input_field: str = "features"  # the DSPy program's input field (text programs take the text)
    image_files: bool = False  # inputs are image files: read from folders (which give the splits,
    # never --val_path/--test_path), decoded within --max_image_memory_mb
    learning_rate: float | None = None  # its default peak learning rate (None: the tool's)
    refused_flags: tuple[str, ...] = ()  # flags it does not take (config: exit 2 when given)
    own_flags: tuple[str, ...] = ()  # flags no other type takes (config: exit 2 for the others)
    flags: str = ""  # "module:Class": a dataclass of the flags it declares itself (with
    # ttc.options.fields.opt; no numpy or torch at import), composed into the Config after the
    # training flags (ttc/options/training.py TYPE_FLAGS); its own_flags name them
    guide: str = "cli.md"  # the docs page that says what it takes
    split_paths: bool = True  # --val_path/--test_path name its validation and test data (an
    # image classifier's splits come from its folders only)
    reads_lines: bool = False  # --input - (one input per line of stdin)
    augments: bool = False  # --train_augment applies
    hf_archs: bool = False  # --arch hf:NAME (a Hugging Face model) is one of its networks
    teacher: bool = False  # --teacher (an LLM labelling its texts) applies
    missing_values: bool = False  # NaN is a value (a missing feature), not a bad input
    scored_by: str = "accuracy"  # what train_accuracy and val_accuracy hold (the report's
    # train.metric when not accuracy): a classifier's accuracy, "mean_iou", "map"
    program: str = "ClassifierProgram"  # its DSPy program's name, as the manifest records it
    calibrated_on: str = "samples"  # what a temperature is fitted on: "samples" or "pixels"
    uncalibrated: str = ""  # why --calibrate temperature fits nothing for it ("": it fits)
    calibration_slice: bool = False  # it uses the calibration slice itself (a regressor's
    # conformal intervals): the slice is kept at --calibration_fraction though `uncalibrated`
    min_labels: int = 2  # the manifest's labels: a classifier's classes; a regressor's 1 target
    plots: tuple[tuple[str, str], ...] = ()  # its own plots, (name, caption): drawn by its
    # Parts.report's `plots`, shown in the evaluation section (ttc/reporting/sections.py)
    class_prior: bool = True  # its training loss is a cross-entropy over classes: the class
    # shares' entropy is what a network that learned nothing reaches (the training health)
    image_loop: bool = False  # trains with ttc/nets/image_loop.py (its trainer module's
    # plan_training makes an ImagePlan): --engine ray trains it with an ImageRunner per worker
    tta_graph: bool = False  # export.py --tta writes its TTA graph (model.tta.onnx) in the bundle
    masks: bool = False  # its labels are masks: --ignore_index (void pixels) applies, and
    # --input writes a mask per image (config.Config.validate_tta checks its folder)

    @property
    def default_arch(self) -> str:
        return self.archs[0]

    def part(self, role: str) -> Any:
        """The object of one of `parts`' roles ("reader", "trainer", "exporter", ...)."""
        return resolve(getattr(self.parts, role))

    def graph_input(self, preprocessing: dict) -> dict:
        """The graph input the manifest promises (its `input`), with the axes that are dynamic."""
        raise NotImplementedError(self.name)

    def graph_outputs(self, num_classes: int) -> list[dict]:
        """The graph outputs the manifest promises: a classifier's logits and calibrated
        probabilities, (batch, classes) float32."""
        return [{"name": name, "shape": ["batch", num_classes], "dtype": "float32"}
                for name in ("logits", "probabilities")]

    def fixed_input_dims(self, preprocessing: dict) -> list[int | None]:
        """The input's dimensions after the batch that the record fixes, which a bundle's graph
        must have (checked when it loads); none where they vary (a text's length)."""
        return []

    def report_sizes(self, preprocessing: dict) -> dict:
        """The input's sizes the report's data section shows."""
        raise NotImplementedError(self.name)

    def factory_sizes(self, preprocessing: dict) -> dict:
        """The sizes a --model_def factory builds its network from (beside the graph input)."""
        raise NotImplementedError(self.name)
