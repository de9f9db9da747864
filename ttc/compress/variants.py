"""The compressed variants of a trained network, made before export: pruned (a smaller dense
network), qat (fake-quantized, exported as a QDQ int8 graph) and pruned_qat (both, pruning
first). Each fine-tunes with the training loop that trained the network (WeightTrainer, the
best validation epoch kept), at FINE_TUNE_RATE of its learning rate.

A bundle keeps each variant's weights (model.<name>.pt) and, for pruned networks, the
parameter shapes (plain JSON) that rebuild it from the manifest's architecture: loading one
runs no code of the bundle's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np
import torch
from torch import nn

from ttc.compress.pruning import (count_macs, prune_channels, prune_unsupported_reason,
                                  resized_to, shapes_of)
from ttc.compress.qat import (frozen_for_export, prepare_qat, qat_unsupported_reason)
from ttc.inputs.preprocess import PAD_ID
from ttc.nets.models import count_parameters
from ttc.options.compress import FINE_TUNE_RATE
from utils import LOG, ConfigError

if TYPE_CHECKING:
    from ttc.inputs.data import Dataset
    from ttc.nets.training import TrainedModel
    from ttc.options.stages import TrainingOptions

EXAMPLE_ROWS = 4  # the tracing example: a few training inputs
TAYLOR_BATCHES = 4  # training batches whose gradients rank channels for --prune_importance taylor


@dataclass
class CompressedNet:
    """One compressed variant, as training made it (or a bundle rebuilt it)."""

    name: str  # "pruned", "qat", "pruned_qat"
    net: nn.Module  # pruned: the dense smaller fp32 network; qat: frozen fake-quant (eval)
    recipe: dict
    quantized: bool
    params: int
    macs: int
    shapes: dict[str, list[int]] | None = None  # a pruned network's parameter shapes
    channels: dict | None = None  # per pruned layer: before → after
    val_accuracy_torch: float | None = None
    seconds: float = 0.0
    history: list[dict] = field(default_factory=list)  # the fine-tuning epochs

    def manifest_entry(self, weights_file: str) -> dict:
        """What the manifest records of it (the judged figures join at export)."""
        return {"name": self.name, "recipe": self.recipe, "quantized": self.quantized,
                "params": self.params, "macs": self.macs, "shapes": self.shapes,
                "channels": self.channels, "weights": weights_file,
                "val_accuracy_torch": self.val_accuracy_torch, "seconds": self.seconds}


def example_input(x: np.ndarray, pad_id: int = PAD_ID) -> torch.Tensor:
    from ttc.nets.dspy_program import network_batch

    return network_batch(np.ascontiguousarray(x[:EXAMPLE_ROWS]), pad_id)


def refuse_uncompressible(options: TrainingOptions, net: nn.Module, example: torch.Tensor) -> None:
    """Before any training: a network with no path for what the flags ask is exit 2 with the
    reason and the alternative (flag values and hf networks were checked with the flags)."""
    if options.prune:
        reason = prune_unsupported_reason(net, example)
        if reason:
            raise ConfigError(f"--prune {options.prune:g}: {reason}",
                              "drop --prune, or use --qat / --quantize static")
    if options.qat:
        reason = qat_unsupported_reason(net)
        if reason:
            raise ConfigError(f"--qat: {reason}", "drop --qat and use post-training "
                              "--quantize static (or dynamic)")


class FineTuner:
    """Runs the training loop that trained the network on a compressed copy of it."""

    def __init__(self, options: TrainingOptions, trained: "TrainedModel",
                 dataset: "Dataset") -> None:
        self.options, self.trained, self.dataset = options, trained, dataset

    def __call__(self, net: nn.Module, epochs: int, what: str, mixed_precision: bool = True
                 ) -> tuple[nn.Module, list[dict]]:
        """Fine-tune `net` for `epochs` on --device; in --amp's precision unless
        `mixed_precision` is False (quantization-aware training: its fake quantizers model int8
        from float32 values)."""
        from ttc.nets.device import training_device
        from ttc.inputs.preprocess import text_tokenizer
        from ttc.nets.classifier_loop import WeightTrainer
        from ttc.nets.dspy_program import ClassifierProgram, label_match, to_examples
        from ttc.tasks.registry import task_of_kind

        if epochs == 0:
            return net, []
        options, dataset = self.options, self.dataset
        task = task_of_kind(dataset.preprocessing["kind"])
        tokenizer = text_tokenizer(dataset.preprocessing) if task.input_role == "text" else None
        pad_id = dataset.preprocessing.get("pad_id", PAD_ID)
        program = ClassifierProgram(net, dataset.labels, task.input_field, tokenizer, pad_id)
        rate = self.trained.learning_rate * FINE_TUNE_RATE
        LOG.info("%s: fine-tuning %d epoch%s at learning rate %.3g", what, epochs,
                 "s" if epochs > 1 else "", rate)
        trainer = WeightTrainer(
            label_match, epochs=epochs, batch_size=options.batch_size, learning_rate=rate,
            recipe=options.recipe(options.model_type, options.arch, options.model_def),
            augment=options.train_augment and task.augments, seed=self.trained.seed,
            show_progress=not options.no_progress, pad_id=pad_id,
            device=training_device(options.device),
            amp=options.amp if mixed_precision else "off")
        tuned = trainer.compile(program,
                                trainset=to_examples(dataset.train, dataset.labels,
                                                     task.input_field),
                                valset=to_examples(dataset.val, dataset.labels,
                                                   task.input_field))
        return tuned.net, [vars(record) for record in trainer.history]


def taylor_batches(dataset: "Dataset", batch_size: int, seed: int
                   ) -> Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]]:
    """A few shuffled training batches (inputs, labels) for Taylor importance's gradients."""
    from ttc.nets.dspy_program import network_batch

    pad_id = dataset.preprocessing.get("pad_id", PAD_ID)

    def batches() -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        order = np.random.default_rng(seed).permutation(len(dataset.train))
        for start in range(0, min(len(order), TAYLOR_BATCHES * batch_size), batch_size):
            rows = np.sort(order[start:start + batch_size])
            yield (network_batch(dataset.train.x[rows], pad_id),
                   torch.from_numpy(np.asarray(dataset.train.y[rows], dtype=np.int64)))
    return batches


def compress_trained(options: TrainingOptions, trained: "TrainedModel", dataset: "Dataset"
                     ) -> tuple[list[CompressedNet], dict]:
    """The variants --prune and --qat ask for, in order (pruned, qat, pruned_qat), and the
    trained network's own parameters and MACs (the compression table's first row)."""
    tune = FineTuner(options, trained, dataset)
    example = example_input(dataset.train.x, dataset.preprocessing.get("pad_id", PAD_ID))
    fp32 = fp32_record(trained.net, example)
    made: dict[str, CompressedNet] = {}
    for name, recipe in options.compress_recipes():
        started = time.perf_counter()
        if name == "pruned":
            made[name] = pruned_variant(options, trained.net, example, tune, recipe, dataset)
        else:
            source = made["pruned"] if name == "pruned_qat" else None
            made[name] = qat_variant(trained.net if source is None else source.net, example,
                                     tune, recipe, name, options.qat_epochs, source)
        variant = made[name]
        variant.seconds = round(time.perf_counter() - started, 3)
        variant.val_accuracy_torch = split_accuracy_of(variant.net, dataset)
        LOG.info("%s: %s parameters (%s MACs), validation accuracy in PyTorch %s (%.1fs)",
                 name, f"{variant.params:,}", f"{variant.macs:,}",
                 "n/a" if variant.val_accuracy_torch is None
                 else f"{variant.val_accuracy_torch:.4f}", variant.seconds)
    return list(made.values()), fp32


def split_accuracy_of(net: nn.Module, dataset: "Dataset") -> float | None:
    from ttc.nets.dspy_program import split_accuracy

    return split_accuracy(net.eval(), dataset.val)


def pruned_variant(options: TrainingOptions, net: nn.Module, example: torch.Tensor,
                   tune: FineTuner, recipe: dict, dataset: "Dataset") -> CompressedNet:
    history: list[dict] = []

    def fine_tune(pruned: nn.Module, step: int) -> nn.Module:
        tuned, records = tune(pruned, options.prune_epochs,
                              f"pruning step {step + 1}/{options.prune_steps}")
        history.extend({**r, "step": step + 1} for r in records)
        return tuned

    loss_batches = (taylor_batches(dataset, options.batch_size, options.seed)
                    if options.prune_importance == "taylor" else None)
    result = prune_channels(net, example, options.prune, options.prune_steps,
                            options.prune_importance, fine_tune, loss_batches)
    pruned = result.net.eval()
    return CompressedNet(name="pruned", net=pruned, recipe=recipe, quantized=False,
                         params=count_parameters(pruned), macs=count_macs(pruned, example),
                         shapes=shapes_of(pruned), channels=result.channels, history=history)


def qat_variant(net: nn.Module, example: torch.Tensor, tune: FineTuner, recipe: dict,
                name: str, epochs: int, source: CompressedNet | None) -> CompressedNet:
    prepared = prepare_qat(net.eval(), example)
    tuned, history = tune(prepared, epochs, f"quantization-aware training ({name})",
                          mixed_precision=False)
    frozen = frozen_for_export(tuned)
    return CompressedNet(name=name, net=frozen, recipe=recipe, quantized=True,
                         params=count_parameters(net), macs=count_macs(net, example),
                         shapes=source.shapes if source else None,
                         channels=source.channels if source else None, history=history)


def rebuilt_variant(fp32: nn.Module, entry: dict, state: dict, example: torch.Tensor
                    ) -> nn.Module:
    """A bundle's variant from its fp32 network (loaded from model.pt, which only supplies the
    architecture), its recorded shapes and its own weights: no code of the bundle runs."""
    net = resized_to(fp32, entry["shapes"]) if entry.get("shapes") else fp32
    if entry.get("quantized"):  # the frozen module tree the weights were saved from
        net = frozen_for_export(prepare_qat(net.eval(), example))
    net.load_state_dict(state)
    return net.eval()


def compression_record(variants: list[CompressedNet], graphs: list, paths, draft: dict) -> dict:
    """The manifest's compression section after export: each variant's recipe, size and
    checks (the gate's verdict joins in quantize.judge_compressed); fp32's own figures first."""
    previous = draft.get("compression") or {}
    entries = []
    for variant, graph in zip(variants, graphs):
        entries.append({
            **variant.manifest_entry(paths.variant_weights(variant.name).name),
            "file": paths.variant(variant.name).name, "size_bytes": graph.model.ByteSize(),
            "nodes": graph.nodes, "max_abs_diff": graph.check.max_abs_diff,
            "top1_agreement": graph.check.top1_agreement, "qdq": graph.structure})
    return {"fp32": previous.get("fp32"), "variants": entries, "served": None}


def fp32_record(net: nn.Module, example: torch.Tensor) -> dict:
    """The uncompressed network's parameters and MACs, the compression table's first row."""
    return {"params": count_parameters(net), "macs": count_macs(net, example)}


def compression_draft(variants: list[CompressedNet], fp32: dict, paths) -> dict:
    """The manifest's compression section as training writes it (no graphs yet)."""
    return {"fp32": fp32, "served": None,
            "variants": [v.manifest_entry(paths.variant_weights(v.name).name) for v in variants]}


def load_compressed(manifest, paths, fp32: nn.Module, example: torch.Tensor
                    ) -> list[CompressedNet]:
    """A bundle's compressed variants rebuilt for export.py: each from the fp32 network's
    architecture, its recorded shapes and its own weights file (weights_only: never unpickle),
    checked against the manifest's sha256 first."""
    import copy

    from ttc.nets.models import TorchFileError, load_torch_file, weights_error
    from ttc.serving.bundle import bundle_file
    from utils import ExportError, sha256_of

    made = []
    for entry in manifest.compression.variants if manifest.compression else ():
        path = paths.variant_weights(entry.name)
        fix = "re-run train.py or pipeline.py with the same --prune / --qat"
        if bundle_file(path, "weights") is None:
            raise ExportError(f"the {entry.name} variant's weights {path} are missing", fix)
        if sha256_of(path) != manifest.files.digest(f"weights_{entry.name}"):
            raise ExportError(f"{path} does not match its manifest (sha256 differs)", fix)
        try:
            state = load_torch_file(path)
        except TorchFileError as err:
            raise ExportError(f"cannot load the {entry.name} variant's weights {path}: {err}",
                              fix) from None
        try:
            net = rebuilt_variant(copy.deepcopy(fp32), entry.entry, state, example)
        except Exception as err:  # noqa: BLE001 - any failure here means an unusable file
            raise ExportError(f"cannot rebuild the {entry.name} variant from {path}: "
                              f"{weights_error(err)}", fix) from None
        record = entry.entry
        made.append(CompressedNet(
            name=entry.name, net=net, recipe=record.get("recipe") or {},
            quantized=entry.quantized, params=record.get("params") or count_parameters(net),
            macs=record.get("macs") or 0,
            shapes=None if entry.shapes is None else {k: list(v) for k, v in entry.shapes.items()},
            channels=record.get("channels"), val_accuracy_torch=record.get("val_accuracy_torch"),
            seconds=record.get("seconds") or 0.0))
    return made


def check_compressible(options: TrainingOptions, dataset: "Dataset") -> None:
    """refuse_uncompressible on a freshly built network for this data, before training."""
    from ttc.nets.models import build_model
    from ttc.nets.training import network_architecture

    if len(dataset.train) == 0:
        return
    net = build_model(network_architecture(options, dataset), dataset.preprocessing)
    refuse_uncompressible(options, net.eval(), example_input(
        dataset.train.x, dataset.preprocessing.get("pad_id", PAD_ID)))
