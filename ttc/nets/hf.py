"""Hugging Face transformers for text: `--arch hf:NAME_OR_PATH`.

A local directory (`save_pretrained`) or a hub name: its fast tokenizer becomes the bundle's
tokenizer.json (preprocess.HFTokenizer serves it without torch or transformers), and
AutoModelForSequenceClassification, with this data's labels, becomes the network the pipeline
fine-tunes and exports with the inputs transformers models take: input_ids, attention_mask and,
when the model reads them, token_type_ids. Importing this module imports torch; transformers is
imported when a model or tokenizer is loaded.
"""
from __future__ import annotations

import inspect
import os
from typing import Sequence

import torch
from torch import nn

from ttc.inputs.preprocess import (HF_PREFIX, HF_TOKENIZER, configure_hf_backend,
                        register_hf_tokenizer)
from utils import LOG, ConfigError, DataError, ExportError, first_line, stdout_to_stderr

GRAPH_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def from_pretrained(loader, source: str, **kwargs):
    """`loader.from_pretrained(source)`, its many failures (not a directory, not in the cache and
    no network, no weights) as one line: exit 3."""
    try:
        with stdout_to_stderr():
            return loader.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as err:  # transformers' "not found" errors are OSErrors
        if os.path.isdir(source):
            raise DataError(f"--arch hf:{source}: cannot load {loader.__name__} from that "
                            f"directory: {first_line(err, 300)}",
                            "give a directory written by save_pretrained (config.json, "
                            "tokenizer.json and the weights)") from None
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        raise DataError(f"--arch hf:{source}: not a local directory, and not in the Hugging "
                        f"Face cache {hub_cache()}{' (HF_HUB_OFFLINE is set)' if offline else ''}"
                        f": {first_line(err, 200)}",
                        "download it once where there is network access (python -c \"import "
                        "transformers as t; t.AutoModelForSequenceClassification.from_pretrained("
                        f"'{source}'); t.AutoTokenizer.from_pretrained('{source}')\"), then run "
                        "with HF_HUB_OFFLINE=1, or pass a save_pretrained directory") from None


# ----------------------------------------------------------------------------- the tokenizer


def model_class(config) -> type:
    """The AutoModelForSequenceClassification class for a config, without building it."""
    from transformers import AutoModelForSequenceClassification

    mapping = AutoModelForSequenceClassification._model_mapping
    try:
        return mapping[type(config)]
    except KeyError:
        raise ConfigError(f"--arch hf:{config.name_or_path}: transformers has no sequence "
                          f"classification model for model type {config.model_type!r}",
                          "use an encoder such as BERT, DistilBERT, RoBERTa or DeBERTa") from None


def graph_inputs(config) -> list[str]:
    """The inputs the exported graph takes: input_ids and attention_mask, and token_type_ids when
    the model's forward reads them (BERT does, DistilBERT and RoBERTa-style models need not)."""
    parameters = inspect.signature(model_class(config).forward).parameters
    missing = [name for name in GRAPH_INPUTS[:2] if name not in parameters]
    if missing:
        raise ConfigError(f"--arch hf:{config.name_or_path}: its forward takes no {missing[0]}",
                          "use a text encoder that takes input_ids and attention_mask")
    return [name for name in GRAPH_INPUTS if name in parameters]


def max_positions(config) -> int | None:
    """The longest input the model's position embeddings cover, when its config says."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def tokenizer_preprocessing(source: str, max_length: int) -> dict:
    """The preprocessing spec of an hf arch: its fast tokenizer (registered by the sha256 of its
    tokenizer.json, which the bundle keeps), truncating at `max_length` capped by the model's
    position embeddings, padding with its pad token."""
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = from_pretrained(AutoTokenizer, source)
    config = from_pretrained(AutoConfig, source)
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"--arch hf:{source}: its tokenizer is not a fast (Rust) tokenizer",
                          "give a model whose directory has a tokenizer.json")
    if tokenizer.pad_token_id is None:
        raise ConfigError(f"--arch hf:{source}: its tokenizer has no padding token",
                          "set one (tokenizer.pad_token = ...) and save_pretrained it again")
    limit = min(v for v in (max_length, max_positions(config),
                            getattr(tokenizer, "model_max_length", None))
                if isinstance(v, int) and v > 0)
    if limit < max_length:
        LOG.info("--max_length %d is more than hf:%s takes; texts are cut at %d tokens",
                 max_length, source, limit)
    spec = {"kind": "text", "tokenizer": HF_TOKENIZER, "source": source, "max_length": limit,
            "pad_id": int(tokenizer.pad_token_id), "pad_token": tokenizer.pad_token,
            "unk_id": tokenizer.unk_token_id, "special_ids": sorted(tokenizer.all_special_ids),
            "vocab_size": len(tokenizer), "graph_inputs": graph_inputs(config)}
    backend = RustTokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    configure_hf_backend(backend, spec)
    spec["sha256"] = register_hf_tokenizer(backend.to_str())
    return spec


# ----------------------------------------------------------------------------- the network


def hf_architecture(source: str, preprocessing: dict, labels: Sequence[str]) -> dict:
    """The manifest's description of an hf network: its transformers config with this data's
    labels, so that export.py and Tent rebuild it without the hub."""
    from transformers import AutoConfig

    config = from_pretrained(AutoConfig, source, num_labels=len(labels),
                             id2label=dict(enumerate(labels)),
                             label2id={label: i for i, label in enumerate(labels)})
    return {"name": "HFTextNet", "arch": f"{HF_PREFIX}{source}", "source": source,
            "num_classes": len(labels), "model_type": config.model_type,
            "pad_id": preprocessing["pad_id"], "graph_inputs": preprocessing["graph_inputs"],
            "hf_config": config.to_dict()}


class HFTextNet(nn.Module):
    """AutoModelForSequenceClassification behind the pipeline's one-tensor interface: token ids
    in (right-padded with the tokenizer's pad id), logits out. The attention mask is 1 where a
    token is not padding and the token types are 0 (one segment: text columns are joined into
    one text), the rule preprocess.text_graph_feed applies to the exported graph's inputs.
    Its state-dict keys sit under `model.`."""

    def __init__(self, num_classes: int, source: str, hf_config: dict, pad_id: int,
                 graph_inputs: Sequence[str], pretrained: bool = False, **_: object) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForSequenceClassification

        if pretrained:
            self.model = from_pretrained(AutoModelForSequenceClassification, source,
                                         config=AutoConfig.for_model(**hf_config),
                                         ignore_mismatched_sizes=True)
        else:
            self.model = rebuilt_model(hf_config)
        if self.model.config.num_labels != num_classes:
            if pretrained:
                raise ConfigError(f"hf:{source} has {self.model.config.num_labels} outputs, the "
                                  f"data {num_classes} classes", "report it")
            raise ExportError("the bundle's architecture.hf_config makes a network of "
                              f"{self.model.config.num_labels} outputs for {num_classes} classes",
                              "re-create the bundle with pipeline.py")
        self.pad_id = pad_id
        self.graph_inputs = tuple(graph_inputs)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        mask = (token_ids != self.pad_id).long()
        return self.graph_forward(token_ids, mask, torch.zeros_like(token_ids))

    def graph_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        extra = {"token_type_ids": token_type_ids} if "token_type_ids" in self.graph_inputs else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits


def rebuilt_model(hf_config: dict) -> nn.Module:
    """An hf network from a bundle's manifest (architecture.hf_config, whoever wrote it): a
    config transformers cannot build a model from is an ExportError (exit 4)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    try:
        return AutoModelForSequenceClassification.from_config(AutoConfig.for_model(**hf_config))
    except Exception as err:  # noqa: BLE001 - transformers raises several types for a config
        raise ExportError("the bundle's architecture.hf_config does not make a transformers "
                          f"model: {first_line(err, 160)}",
                          "re-create the bundle with pipeline.py") from None


class HFGraph(nn.Module):
    """What is exported for an hf network: its graph inputs in, logits and softmax out."""

    def __init__(self, net: HFTextNet, temperature: float = 1.0) -> None:
        super().__init__()
        self.net = net
        self.temperature = float(temperature)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.net.graph_forward(input_ids, attention_mask, token_type_ids)
        return logits, torch.softmax(logits if self.temperature == 1.0
                                     else logits / self.temperature, dim=-1)


# ----------------------------------------------------------------------------- fused export

# ONNX Runtime's BERT fusion, what it may fuse in an exported hf graph: the attention (Q, K, V,
# scores, mask, softmax, context: one com.microsoft Attention node, which dynamic quantization
# turns into QAttention) and the bias + GELU. Not SkipLayerNormalization (its CPU kernel is ~4x
# slower than Add + LayerNormalization at hidden 128, measured with onnxruntime 1.31; sessions
# disable ORT's own SkipLayerNormFusion likewise) and not EmbedLayerNormalization (the
# embeddings' LayerNorm stays a LayerNormalization node, which tent adapts).
FUSED_OPS = ("Attention", "BiasGelu")


def fused_graph(net: HFTextNet, feed: dict, output_names: Sequence[str], opset: int,
                temperature: float = 1.0):
    """The network exported for ONNX Runtime's transformer fusion, or None where nothing fuses.

    The fusion patterns know the TorchScript exporter's graph of transformers' eager attention
    (its transformers 5 mask included), not the dynamo exporter's (sdpa or eager: measured, the
    attention never fused there), so this exports a copy with eager attention through
    torch.onnx.export(dynamo=False) and fuses it unslimmed (onnxslim's merged Reshape and
    Unsqueeze nodes break the patterns too). The caller validates the result like any export."""
    import copy
    import io
    import warnings

    import onnx
    from onnxruntime.transformers.fusion_options import AttentionMaskFormat, FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    eager = copy.deepcopy(net).eval()
    eager.model.set_attn_implementation("eager")
    buffer = io.BytesIO()
    with warnings.catch_warnings(), stdout_to_stderr():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer notes
        torch.onnx.export(HFGraph(eager, temperature),
                          tuple(torch.from_numpy(v) for v in feed.values()),
                          buffer, input_names=list(feed), output_names=list(output_names),
                          dynamic_axes={name: {0: "batch", 1: "length"} for name in feed},
                          opset_version=opset, dynamo=False)
    options = FusionOptions("bert")
    options.enable_skip_layer_norm = False
    options.enable_embed_layer_norm = False
    options.attention_mask_format = AttentionMaskFormat.AttentionMask  # no right-padding assumed
    config = eager.model.config
    with stdout_to_stderr():
        fused = optimize_model(onnx.load_from_string(buffer.getvalue()), model_type="bert",
                               num_heads=config.num_attention_heads,
                               hidden_size=config.hidden_size, opt_level=0,
                               optimization_options=options)
    layers = getattr(config, "num_hidden_layers", None)
    counts = {op: sum(n.op_type == op for n in fused.model.graph.node) for op in FUSED_OPS}
    if counts["Attention"] == 0 or (layers and counts["Attention"] != layers):
        LOG.info("ONNX Runtime's fusion fused %d of %s attention layers: keeping the unfused "
                 "graph", counts["Attention"], layers)
        return None
    model = fused.model
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return model
