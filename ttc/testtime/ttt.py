"""Test-time training on a deployed ONNX model: BatchNorm re-estimation (`bn`, Schneider et al.
2020) and Tent (`tent`, Wang et al. 2021, after DequanWang/tent), episodic or online.

A network with BatchNorm is adapted through the bundle's adaptation graph (model.bn.onnx: the
BatchNorm nodes the deployable graph folds away), rewritten here so that every
BatchNormalization normalises with its input's batch statistics blended with its stored
statistics, w = n / (n + N) for a batch of n samples and a prior of N samples (--ttt_bn_prior;
N = 0: batch statistics only). The blended statistics are graph outputs; the stored statistics
and the affine parameters are graph inputs with the bundle's values as defaults, so one
session.run adapts and predicts and a run can feed other parameters in (no session is rebuilt,
no state lives in the session).

A network without BatchNorm (the text transformer, an --arch hf:... model) is adapted through
model.onnx itself: its LayerNormalization and GroupNormalization nodes survive export and slimming
whole, so their scale and bias initializers become graph inputs with the bundle's values as
defaults (where onnxslim merged equal ones, as in a BERT whose LayerNorms never trained, each
node gets its own copy and the layers pair in order). bn has nothing to adapt there (LayerNorm
keeps no statistics) and is reported as not applicable.

- bn runs in ONNX Runtime only; torch is never imported.
- tent minimises the mean prediction entropy over the affine parameters of the BatchNorm layers
  (or, in a network without BatchNorm, of the LayerNorm and GroupNorm layers) of a PyTorch copy
  rebuilt from model.pt (Adam, --ttt_iterations steps per batch). By default (--ttt_predict
  after) the adapted parameters are fed into the ONNX graph, which gives the predictions: one
  forward pass more than tent.py, whose predictions are the outputs of the forward pass that
  computed the loss, before the step (--ttt_predict before gives those).
- episodic: every batch starts from the bundle's parameters. online: the adapted statistics
  (bn) or parameters (tent) carry over to the next batch, reset every --ttt_reset_every batches
  and, with a WARNING, when the predictions collapse.
- the guard (--ttt_guard, ttt_guard.py) tests each batch's class mix first and keeps correlated
  batches from being adapted to.
"""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ttc.reporting.metrics import accuracy, entropy
from ttc.serving.runtime import batches_of, best_of, graph_padding_id, model_feeder
from ttc.testtime.tta_graph import GraphNodes
from ttc.testtime.ttt_guard import StreamGuard
from utils import LOG, ConfigError, ExportError

if TYPE_CHECKING:  # torch loads only for tent
    import torch

    from ttc.serving.manifest import Manifest
    from ttc.testtime.shift_score import ShiftReference

PRIOR = "ttt_bn_prior"  # graph input: the prior strength N
SOURCE_PRIOR = 1e12  # a prior so strong that the stored statistics win: the unadapted model
EATA_LIMIT = 0.4  # --ttt_guard filter: tent learns from samples under 0.4 ln C of entropy (EATA)


@dataclass(frozen=True)
class BNLayer:
    """One BatchNormalization node: its parameter initializers and its adapted-statistics outputs."""

    scale: str
    bias: str
    mean: str
    var: str
    channels: int

    @property
    def adapted_mean(self) -> str:
        return f"{self.mean}.adapted"

    @property
    def adapted_var(self) -> str:
        return f"{self.var}.adapted"


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model)
    values = [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
    return {v.name: len(v.type.tensor_type.shape.dim) for v in values
            if v.type.tensor_type.HasField("shape")}


def adaptation_model(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[BNLayer]]:
    """The graph with every BatchNormalization fed blended batch statistics (see the module
    docstring); ConfigError (exit 2) when it has none to adapt."""
    out = copy.deepcopy(model)
    graph = out.graph
    initializers = {i.name: i for i in graph.initializer}
    if not any(n.op_type == "BatchNormalization" for n in graph.node):
        raise ConfigError("this model has no BatchNorm layers, and test-time training adapts "
                          "their statistics (bn) and affine parameters (tent)",
                          "use a model with BatchNorm (every architecture this tool trains has "
                          "it) or run without --ttt")
    ranks = _ranks(model)
    graph.initializer.append(numpy_helper.from_array(np.array([0.0], np.float32), PRIOR))
    graph.input.append(helper.make_tensor_value_info(PRIOR, TensorProto.FLOAT, [1]))
    layers, nodes = [], []
    for node in graph.node:
        if node.op_type != "BatchNormalization":
            nodes.append(node)
            continue
        x, scale, bias, mean, var = node.input[:5]
        if any(name not in initializers for name in (scale, bias, mean, var)):
            raise ConfigError(f"BatchNorm node {node.name!r} takes computed parameters",
                              "re-export the bundle with this version's export.py")
        layer = BNLayer(scale, bias, mean, var, int(np.prod(initializers[mean].dims)))
        extra = GraphNodes(f"ttt{len(layers)}")
        adapted_mean, adapted_var = _blended_statistics(extra, x, layer, ranks.get(x, 4))
        adapted = copy.deepcopy(node)
        adapted.input[3:5] = [adapted_mean, adapted_var]
        nodes += [*extra.nodes, adapted]
        graph.initializer.extend(extra.initializers)
        layers.append(layer)
    del graph.node[:]
    graph.node.extend(nodes)
    for layer in layers:
        for name in (layer.scale, layer.bias, layer.mean, layer.var):  # overridable per run
            graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT,
                                                             [layer.channels]))
        for name in (layer.adapted_mean, layer.adapted_var):
            graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT,
                                                              [layer.channels]))
    onnx.checker.check_model(out)
    return out, layers


def _blended_statistics(nodes: GraphNodes, x: str, layer: BNLayer, rank: int
                        ) -> tuple[str, str]:
    """Per-channel mean and biased variance of x over every axis but 1, blended with the stored
    ones: stored + w (batch − stored), w = n / (n + N)."""
    axes = nodes.const([0, *range(2, rank)])
    flat = nodes.const([-1])
    # E[x²] − E[x]²: two reading passes over x and no intermediate tensor of its size
    batch_mean = nodes.op("Reshape", [nodes.op("ReduceMean", [x, axes], keepdims=0), flat])
    squares = nodes.op("ReduceSumSquare", [x, axes], keepdims=0)
    count = nodes.op("Div", [nodes.op("Cast", [nodes.op("Size", [x])], to=TensorProto.FLOAT),
                             nodes.const([float(layer.channels)], np.float32)])
    batch_var = nodes.op("Sub", [nodes.op("Div", [squares, count]),
                                 nodes.op("Mul", [batch_mean, batch_mean])])
    n = nodes.op("Cast", [nodes.op("Shape", [x], start=0, end=1)], to=TensorProto.FLOAT)
    weight = nodes.op("Div", [n, nodes.op("Add", [n, PRIOR])])

    def blend(batch: str, stored: str, output: str) -> str:
        moved = nodes.op("Mul", [weight, nodes.op("Sub", [batch, stored])])
        return nodes.op("Add", [stored, moved], output=output)

    return (blend(batch_mean, layer.mean, layer.adapted_mean),
            blend(batch_var, layer.var, layer.adapted_var))


# ----------------------------------------------------------------------------- LayerNorm, GroupNorm

# ONNX normalisation nodes whose affine parameters tent adapts in a network without BatchNorm,
# and the name of their PyTorch module.
AFFINE_NORMS = {"LayerNormalization": "LayerNorm", "GroupNormalization": "GroupNorm"}


@dataclass(frozen=True)
class AffineNorm:
    """One LayerNormalization or GroupNormalization node: the graph inputs that feed its scale
    and bias (None: the node has no bias), the name the exporter gave its scale (the state_dict
    name, unless the slimmer merged equal constants) and the bundle's values."""

    op_type: str
    scale: str
    bias: str | None
    exported_scale: str
    scale_value: np.ndarray = field(compare=False, repr=False)
    bias_value: np.ndarray | None = field(compare=False, repr=False)


def affine_norm_model(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[AffineNorm]]:
    """The graph with the scale and bias initializers of every LayerNormalization and
    GroupNormalization node made graph inputs (the bundle's values stay their defaults). A
    parameter the node shares with another (onnxslim merges equal constants, such as the ones
    and zeros of layers that never moved) gets a copy of its own first, so that each layer is
    fed separately. ConfigError (exit 2) when there is no such node."""
    out = copy.deepcopy(model)
    graph = out.graph
    initializers = {i.name: i for i in graph.initializer}
    uses = Counter(name for node in graph.node for name in node.input)
    layers: list[AffineNorm] = []
    for node in graph.node:
        if node.op_type not in AFFINE_NORMS or node.domain not in ("", "ai.onnx"):
            continue
        exported_scale, names = node.input[1], []
        for slot in (1, 2):
            name = node.input[slot] if len(node.input) > slot else ""
            if name and name not in initializers:
                raise ConfigError(f"{node.op_type} node {node.name!r} takes computed parameters",
                                  "re-export the bundle with this version's export.py")
            if name and uses[name] > 1:  # shared: this node gets its own copy
                own = f"{name}.ttt{len(graph.initializer)}"
                graph.initializer.append(numpy_helper.from_array(
                    numpy_helper.to_array(initializers[name]), own))
                node.input[slot] = own
                initializers[own] = graph.initializer[-1]
                name = own
            names.append(name or None)
        scale, bias = names
        layers.append(AffineNorm(
            node.op_type, scale, bias, exported_scale, numpy_helper.to_array(initializers[scale]),
            numpy_helper.to_array(initializers[bias]) if bias else None))
    if not layers:
        raise ConfigError("this model has no BatchNorm layers and no LayerNorm or GroupNorm "
                          "ones: test-time training adapts their statistics (bn) or affine "
                          "parameters (tent)", "use a model with one of them, or run without "
                          "--ttt")
    inputs = {i.name for i in graph.input}
    for name in (n for layer in layers for n in (layer.scale, layer.bias) if n and n not in inputs):
        init = initializers[name]
        graph.input.append(helper.make_tensor_value_info(name, init.data_type, list(init.dims)))
    onnx.checker.check_model(out)
    return out, layers


def paired_norm_modules(net: torch.nn.Module, layers: list[AffineNorm]
                        ) -> list[torch.nn.Module]:
    """The PyTorch LayerNorm or GroupNorm module behind each graph layer: by the exporter's
    state_dict names where they name one module per layer, else in order. Either way the count,
    the shapes and the values must agree (the graph's defaults are model.pt's parameters):
    ExportError (exit 4) otherwise."""
    import torch

    modules = [(name, m) for name, m in net.named_modules()
               if isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm))
               and getattr(m, "weight", None) is not None]
    if len(modules) != len(layers):
        raise ExportError(f"model.pt has {len(modules)} LayerNorm/GroupNorm layers with affine "
                          f"parameters and model.onnx {len(layers)} LayerNormalization/"
                          "GroupNormalization nodes", "re-export the bundle with export.py")
    by_name = {key: m for name, m in modules for key in (f"net.{name}.weight", f"{name}.weight")}
    named = [by_name.get(layer.exported_scale) for layer in layers]
    chosen = (named if None not in named and len({id(m) for m in named}) == len(named)
              else [m for _, m in modules])
    for layer, module in zip(layers, chosen):
        _require_same_parameters(layer, module)
    return chosen


def _require_same_parameters(layer: AffineNorm, module: torch.nn.Module) -> None:
    pairs = [(layer.scale_value, module.weight)]
    if (layer.bias is None) != (module.bias is None):
        raise ExportError(f"the {layer.op_type} node of {layer.exported_scale!r} and its PyTorch "
                          "layer disagree on having a bias", "re-export the bundle with export.py")
    if module.bias is not None:
        pairs.append((layer.bias_value, module.bias))
    for value, parameter in pairs:
        expected = parameter.detach().numpy()
        if value.shape != expected.shape or not np.allclose(value, expected, rtol=0, atol=1e-6):
            raise ExportError(f"the {layer.op_type} parameters {layer.exported_scale!r} of "
                              "model.onnx differ from model.pt's (shape or values)",
                              "re-export the bundle with export.py")


def patched_model(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of the (unrewritten) adaptation graph with some initializers replaced: adapted
    statistics or affine parameters written into an ordinary inference graph."""
    out = copy.deepcopy(model)
    for init in out.graph.initializer:
        if init.name in values:
            init.CopyFrom(numpy_helper.from_array(
                np.asarray(values[init.name], np.float32).reshape(tuple(init.dims)), init.name))
    return out


class AdaptationGraph:
    """A session of the adaptation graph: a batch and parameters in, probabilities (and, with
    BatchNorm, adapted statistics) out. Sessions hold no adapted state, so callers can share one.

    A graph with BatchNormalization nodes is rewritten by adaptation_model (bn and tent adapt
    BatchNorm, as always); one without, by affine_norm_model (tent adapts LayerNorm/GroupNorm,
    bn does not apply: `not_applicable` says why)."""

    def __init__(self, model: onnx.ModelProto, make_session: Callable[[bytes], object],
                 primary: Sequence[str] = ("probabilities",)) -> None:
        self.source = model
        self.primary = list(primary)  # the graph's own outputs run returns (a detector's four)
        self.batchnorm = any(n.op_type == "BatchNormalization" for n in model.graph.node)
        if self.batchnorm:
            rewritten, self.layers = adaptation_model(model)
        else:
            rewritten, self.layers = affine_norm_model(model)
        self.session = make_session(rewritten.SerializeToString())
        self.feed = model_feeder(model)
        self.pad_id = graph_padding_id(model)
        self.outputs = self.primary + [n for layer in self.layers if self.batchnorm
                                       for n in (layer.adapted_mean, layer.adapted_var)]

    @property
    def normalisation(self) -> str:
        """What the graph normalises with: BatchNorm, LayerNorm, GroupNorm or both of the last."""
        if self.batchnorm:
            return "BatchNorm"
        return " and ".join(dict.fromkeys(AFFINE_NORMS[layer.op_type] for layer in self.layers))

    @property
    def not_applicable(self) -> dict[str, str]:
        """Each method that cannot adapt this graph, with the reason."""
        if self.batchnorm:
            return {}
        return {"bn": f"the network has no BatchNorm layers (its normalisation is "
                      f"{self.normalisation})"}

    def applicable(self, methods: list[str]) -> list[str]:
        """`methods` less those that do not apply; ConfigError (exit 2) when none is left."""
        kept = [m for m in methods if m not in self.not_applicable]
        if not kept:
            raise ConfigError(f"--ttt_method {methods[0]} does not apply: "
                              f"{self.not_applicable[methods[0]]}",
                              f"use --ttt_method tent, which adapts the {self.normalisation} "
                              "affine parameters")
        return kept

    def run(self, x: np.ndarray, prior: float, params: dict[str, np.ndarray]
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(probabilities, {stored-statistic name: adapted value}) for one batch; without
        BatchNorm there are no statistics and `prior` is ignored."""
        outputs, stats = self.run_outputs(x, prior, params)
        return outputs[0], stats

    def run_outputs(self, x: np.ndarray, prior: float, params: dict[str, np.ndarray]
                    ) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
        """(the `primary` outputs, {stored-statistic name: adapted value}) for one batch."""
        feed = {**self.feed(x), **params}
        if self.batchnorm:
            feed[PRIOR] = np.array([prior], np.float32)
        results = self.session.run(self.outputs, feed)
        primary, stats = results[:len(self.primary)], results[len(self.primary):]
        names = [n for layer in self.layers if self.batchnorm for n in (layer.mean, layer.var)]
        return primary, dict(zip(names, stats))


class Tent:
    """Entropy minimisation over normalisation affine parameters of a PyTorch copy of the
    network (Wang et al. 2021; configure, collect, adapt and reset follow DequanWang/tent's
    tent.py, but tent.py puts the whole model in train mode and returns the outputs of the
    forward pass before the step, while here dropout stays off and adapt_and_predict predicts
    after the step unless asked for tent.py's outputs):
    with BNLayer layers, those of BatchNorm, which normalises with batch statistics; with
    AffineNorm layers (a network without BatchNorm), those of LayerNorm and GroupNorm, which need
    no configuring since they keep no statistics. The rest of the network stays in eval mode
    (dropout off). The entropy is that of the probabilities the bundle serves, softmax(logits /
    T) with the manifest's temperature. `adapt` returns the parameters under the ONNX graph's
    names."""

    def __init__(self, manifest: Manifest, weights: Path, layers: list[BNLayer] | list[AffineNorm],
                 learning_rate: float, steps: int, num_threads: int = 1,
                 trust_model_code: bool = False, filter_unreliable: bool = False) -> None:
        import torch

        from ttc.nets.models import load_weights
        from utils import quiet_library_loggers

        quiet_library_loggers()  # importing torch resets some loggers
        if num_threads > 0:
            torch.set_num_threads(num_threads)

        self.torch, self.steps, self.learning_rate = torch, steps, learning_rate
        self.filter_unreliable = filter_unreliable  # EATA: see step
        self.filtered = 0  # samples left out of the loss so far
        self.net = load_weights(manifest, weights, trust_model_code).eval()
        self.net.requires_grad_(False)
        self.temperature = manifest.temperature
        if all(isinstance(layer, BNLayer) for layer in layers):
            norms = self._batchnorm_modules(layers)
        else:
            norms = paired_norm_modules(self.net, layers)
        for norm in norms:
            norm.requires_grad_(True)
        # (graph input name, torch parameter) for every adapted tensor
        self.pairs = [(name, parameter) for norm, layer in zip(norms, layers)
                      for name, parameter in ((layer.scale, norm.weight), (layer.bias, norm.bias))
                      if parameter is not None]
        self.initial = [parameter.detach().clone() for _, parameter in self.pairs]
        self.reset()

    def _batchnorm_modules(self, layers: list[BNLayer]) -> list[torch.nn.Module]:
        """The BatchNorm modules, in order, set to normalise with batch statistics."""
        norms = [m for m in self.net.modules()
                 if isinstance(m, self.torch.nn.modules.batchnorm._BatchNorm)]
        if len(norms) != len(layers):
            raise ConfigError(f"model.pt has {len(norms)} BatchNorm layers, the adaptation "
                              f"graph {len(layers)}", "re-export the bundle")
        for norm in norms:  # batch statistics in the forward, gradients for the affine
            norm.train()
            norm.track_running_stats = False
            norm.running_mean = norm.running_var = None
        return norms

    def reset(self) -> None:
        """The bundle's parameters and a fresh Adam state (its moments and step count)."""
        with self.torch.no_grad():
            for (_, parameter), value in zip(self.pairs, self.initial):
                parameter.copy_(value)
        if getattr(self, "optimizer", None) is None:
            self.optimizer = self.torch.optim.Adam([p for _, p in self.pairs],
                                                   lr=self.learning_rate, betas=(0.9, 0.999))
        self.optimizer.state.clear()

    def adapt(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """`steps` steps on the batch (see step): the adapted parameters."""
        self.step(x)
        return self.parameters()

    def step(self, x: np.ndarray) -> np.ndarray | None:
        """`steps` entropy-minimising steps on the batch: the probabilities of the last step's
        forward pass, before its update (what tent.py's forward returns, and `--ttt_predict
        before` serves; None for 0 steps). With `filter_unreliable`, samples
        whose entropy is above EATA_LIMIT ln C stay out of the loss (EATA's reliable samples,
        Niu et al. 2022), and a batch of only those takes no step."""
        batch = self.torch.from_numpy(np.ascontiguousarray(x))
        log_probs = None
        for _ in range(self.steps):
            log_probs = (self.net(batch) / self.temperature).log_softmax(1)
            entropies = -(log_probs.exp() * log_probs).sum(1)
            if self.filter_unreliable:
                reliable = entropies.detach() < EATA_LIMIT * np.log(log_probs.shape[1])
                self.filtered += int((~reliable).sum())
                entropies = entropies[reliable]
            if len(entropies):
                entropies.mean().backward()
                self.optimizer.step()
                self.optimizer.zero_grad()
        return log_probs.detach().exp().numpy() if log_probs is not None else None

    def parameters(self) -> dict[str, np.ndarray]:
        """The current affine parameters, under the ONNX graph's names."""
        return {name: p.detach().numpy().copy() for name, p in self.pairs}


# ----------------------------------------------------------------------------- running


def ttt_batches(x: np.ndarray, batch_size: int, pad_id: int) -> list[np.ndarray]:
    """Batches for adaptation; a last batch under half the size joins the one before, because
    statistics of a handful of samples are noise."""
    batches = batches_of(x, batch_size, pad_id)
    if len(batches) > 1 and len(batches[-1]) < batch_size / 2:
        tail = x[(len(batches) - 2) * batch_size:]
        batches = batches[:-2] + batches_of(tail, len(tail), pad_id)
    return batches


def collapse_reason(adapted: np.ndarray, source: Callable[[], np.ndarray]) -> str | None:
    """Why online adaptation looks collapsed on this batch, or None: predictions piling onto one
    class (≥ 90% of the batch, 20 points more than the unadapted model gives it), or entropy near
    zero (under 1e-3 of its maximum and a tenth of the unadapted model's). `source` (the
    unadapted predictions) is computed only when a batch looks suspicious."""
    if len(adapted) < 8:
        return None
    top = np.bincount(adapted.argmax(1), minlength=adapted.shape[1])
    share = top.max() / len(adapted)
    scaled_entropy = float(entropy(adapted).mean() / np.log(adapted.shape[1]))
    if share < 0.9 and scaled_entropy >= 1e-3:
        return None
    plain = source()
    plain_share = np.bincount(plain.argmax(1), minlength=plain.shape[1])[top.argmax()] / len(plain)
    if share >= 0.9 and share - plain_share >= 0.2:
        return (f"{share:.0%} of a batch predicted as one class (the unadapted model: "
                f"{plain_share:.0%})")
    plain_entropy = float(entropy(plain).mean() / np.log(plain.shape[1]))
    if scaled_entropy < 1e-3 and scaled_entropy < plain_entropy / 10:
        return f"prediction entropy collapsed to {scaled_entropy:.1e} of its maximum"
    return None


@dataclass
class Adaptation:
    probabilities: np.ndarray
    resets: int = 0
    skipped: int = 0  # batches the guard kept from adapting (--ttt_guard filter)


@dataclass
class OnlineCarry:
    """What online adaptation carries from one call to the next, for callers that see the data
    in chunks (inference.py --input): the adapted statistics and the batch count (tent keeps its
    parameters in its Tent object)."""

    state: dict = field(default_factory=dict)
    batches: int = 0


def adapt_and_predict(graph: AdaptationGraph, method: str, x: np.ndarray, batch_size: int,
                      mode: str, prior: float, reset_every: int, tent: Tent | None = None,
                      carry: OnlineCarry | None = None, guard: StreamGuard | None = None,
                      predict_before: bool = False) -> Adaptation:
    """Run `method` over x batch by batch. Episodic: every batch from the bundle's parameters.
    Online: statistics (bn) or affine parameters (tent) carry over, across calls too when the
    caller passes the same `carry`; a fresh carry starts from the bundle's parameters (tent's
    too, which live in the Tent object). `guard` tests each batch first (ttt_guard.py; None:
    online adaptation resets on collapse only, as before the guard). `predict_before`: tent's
    predictions come from its last forward pass, before the update (tent.py's outputs)."""
    graph.applicable([method])
    carry = carry if carry is not None else OnlineCarry()
    state: dict[str, np.ndarray] = carry.state
    out, counts = [], Adaptation(np.zeros(0))
    for i, batch in enumerate(ttt_batches(x, batch_size, graph.pad_id), start=carry.batches):
        carry.batches = i + 1
        if mode == "episodic" or i == 0 or (reset_every and i % reset_every == 0):
            state = {}
            if tent is not None:
                tent.reset()
        if guard is not None and guard.active:
            source = graph.run(batch, SOURCE_PRIOR, {})[0]
            reason = guard.correlated(source)
            if reason:
                LOG.debug("test-time training guard (%s) at batch %d: %s", guard.mode, i + 1,
                          reason)
                probabilities, state = _guarded(graph, guard, batch, source, state, tent,
                                                counts)
                out.append(probabilities)
                continue
        if tent is not None:
            observed = tent.step(batch)
            if predict_before and observed is not None:
                probabilities = observed
            else:
                probabilities, stats = graph.run(batch, 0.0, tent.parameters())
                state = stats if mode == "online" else state
        else:
            probabilities, stats = graph.run(batch, prior, state)
            state = stats if mode == "online" else state
        if mode == "online" and (guard is None or guard.active):
            reason = collapse_reason(probabilities,
                                     lambda b=batch: graph.run(b, SOURCE_PRIOR, {})[0])
            if reason:
                LOG.warning("online %s adaptation reset to the bundle's parameters at batch %d: "
                            "%s", method, i + 1, reason)
                state, counts.resets = {}, counts.resets + 1
                if tent is not None:
                    tent.reset()
        out.append(probabilities)
    carry.state = state
    counts.probabilities = np.concatenate(out)
    return counts


def _guarded(graph: AdaptationGraph, guard: StreamGuard, batch: np.ndarray, source: np.ndarray,
             state: dict, tent: Tent | None, counts: Adaptation
             ) -> tuple[np.ndarray, dict]:
    """A batch the guard found correlated: its predictions and the state adaptation goes on
    with. reset: the unadapted model's predictions, and back to the bundle's parameters.
    filter: no adaptation to this batch, which is predicted with the statistics of the last
    batch adapted to (online; tent with its current parameters) or the unadapted model
    (episodic), and the state adaptation goes on with is kept."""
    if guard.mode == "reset":
        guard.resets += 1
        counts.resets += 1
        if tent is not None:
            tent.reset()
        return source, {}
    guard.skipped += 1
    counts.skipped += 1
    if state:
        parameters = tent.parameters() if tent is not None else {}
        return graph.run(batch, SOURCE_PRIOR, {**state, **parameters})[0], state
    return source, state


# ----------------------------------------------------------------------------- evaluation


@dataclass
class TTTSettings:
    method: str  # bn, tent or all
    mode: str
    iterations: int
    learning_rate: float
    bn_prior: float
    reset_every: int
    batch_size: int
    shifts: list[str]
    severity: int
    seed: int
    num_threads: int = 1  # tent's PyTorch threads
    trust_model_code: bool = False  # tent may import a --model_def bundle's model.def.py
    guard: str = "filter"  # none, reset or filter (ttt_guard.py)
    predict: str = "after"  # tent: after or before its update
    stream: str | None = None  # --eval_stream's order (ttt_stream.py)
    stream_passes: int = 3

    @property
    def methods(self) -> list[str]:
        return ["bn", "tent"] if self.method == "all" else [self.method]

    def new_guard(self) -> StreamGuard:
        """A guard for one stream: it remembers the stream's recent class mix."""
        return StreamGuard(self.guard, self.seed)

    def run(self, graph: AdaptationGraph, method: str, x: np.ndarray, tent: Tent | None,
            carry: OnlineCarry | None = None, guard: StreamGuard | None = None) -> Adaptation:
        """adapt_and_predict with these settings (a fresh guard unless one is given)."""
        return adapt_and_predict(graph, method, x, self.batch_size, self.mode, self.bn_prior,
                                 self.reset_every, tent if method == "tent" else None, carry,
                                 guard if guard is not None else self.new_guard(),
                                 self.predict == "before")


@dataclass
class TTTResult:
    method: str
    mode: str
    iterations: int
    bn_prior: float
    learning_rate: float
    batch_size: int
    severity: int
    clean: dict
    shifts: list[dict]
    mean_shifted: dict | None
    resets: dict
    verdict: str = ""
    guard: str = "filter"
    predict: str = "after"
    skipped: dict = field(default_factory=dict)  # method → batches the guard kept from adapting
    stream: dict | None = None  # --eval_stream (ttt_stream.py)
    not_applicable: dict = field(default_factory=dict)  # method → why it cannot adapt this graph
    shift: dict | None = None  # the label-free shift score per case (shift_score.py)
    warnings: list[str] = field(default_factory=list)

    def report_section(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "warnings"}


TIMING_PASSES = 3


def evaluate_ttt(settings: TTTSettings, graph: AdaptationGraph, predict: Callable,
                 tent: Tent | None, x: np.ndarray, y: np.ndarray, preprocessing: dict,
                 reference: ShiftReference | None = None) -> TTTResult:
    """Accuracy without adaptation and with each method that applies to the graph, on the clean
    test split and on every corrupted copy of it; cost = adaptation time / plain inference time
    on the same batches; the label-free shift score of each case's batches, from the unadapted
    model's predictions, against `reference` (the bundle's held-out predictions; None: the
    section says why there is no score). A method asked for that does not apply (bn without
    BatchNorm) keeps null figures and its reason in `not_applicable`."""
    from ttc.inputs.shifts import corrupt
    from ttc.testtime.shift_score import shift_section

    methods = graph.applicable(settings.methods)

    cases = [("clean", 0, x)] + [(name, settings.severity,
                                  corrupt(x, name, settings.severity, preprocessing, settings.seed))
                                 for name in settings.shifts]
    rows, resets, skipped = [], {m: 0 for m in methods}, {m: 0 for m in methods}
    scored: list[tuple[str, int, list[np.ndarray]]] = []
    graph.run(x[: settings.batch_size], 0.0, {})  # warm-up both: first runs allocate
    predict(x[: settings.batch_size])
    if tent is not None:
        tent.adapt(x[: settings.batch_size])
        tent.reset()
    for name, severity, data in cases:
        batches = ttt_batches(data, settings.batch_size, graph.pad_id)
        plain_seconds, plain = best_of(TIMING_PASSES, lambda: np.concatenate(
            [predict(b) for b in batches]))
        ends = np.cumsum([len(b) for b in batches])[:-1]
        scored.append((name, severity, np.split(plain, ends)))  # the shift score's batches
        row = {"name": name, "severity": severity, "accuracy_source": accuracy(plain, y),
               "accuracy_bn": None, "accuracy_tent": None, "cost_ratio_bn": None,
               "cost_ratio_tent": None}
        for method in methods:
            passes = 1 if method == "tent" else TIMING_PASSES  # tent's torch steps dominate
            seconds, adapted = best_of(passes, lambda: settings.run(graph, method, data, tent))
            row[f"accuracy_{method}"] = accuracy(adapted.probabilities, y)
            row[f"cost_ratio_{method}"] = round(seconds / max(plain_seconds, 1e-9), 3)
            resets[method] += adapted.resets
            skipped[method] += adapted.skipped
        LOG.info("ttt %s%s: source %.4f%s", name, f" (severity {severity})" if severity else "",
                 row["accuracy_source"], "".join(f", {m} {row[f'accuracy_{m}']:.4f}"
                                                 for m in methods))
        rows.append(row)
    clean, shifted = rows[0], rows[1:]
    mean_shifted = None
    if shifted:
        mean_shifted = {key: (float(np.mean([r[key] for r in shifted]))
                              if shifted[0][key] is not None else None)
                        for key in ("accuracy_source", "accuracy_bn", "accuracy_tent")}
    result = TTTResult(settings.method, settings.mode, settings.iterations, settings.bn_prior,
                       settings.learning_rate, settings.batch_size, settings.severity,
                       {k: v for k, v in clean.items() if k not in ("name", "severity")},
                       shifted, mean_shifted, resets, guard=settings.guard,
                       predict=settings.predict, skipped=skipped,
                       not_applicable={m: why for m, why in graph.not_applicable.items()
                                       if m in settings.methods})
    result.shift = shift_section(reference, scored, settings.batch_size)
    result.verdict, result.warnings = _verdict(result, methods)
    if not settings.shifts:
        clean_shift = result.shift["cases"][0] if result.shift.get("available") else None
        result.verdict = with_clean_only_hint(
            result.verdict, preprocessing.get("kind"),
            None if clean_shift is None else clean_shift["shift_seen"])
    return result


def with_clean_only_hint(verdict: str, kind: str | None, shift_seen: bool | None = None) -> str:
    """A verdict measured on clean data only (no --eval_shift), ending with how to see what
    adaptation buys under shift (and, where the shift score ran, whether it saw a shift on the
    test split); unchanged for a model type --eval_shift has no corruption for."""
    from ttc.inputs.shifts import CORRUPTIONS

    names = list(CORRUPTIONS.get(kind or "", ()))
    if not names:
        return verdict
    example = "contrast" if "contrast" in names else names[0]
    seen = {None: "", False: "no shift seen on the test split by the shift score, ",
            True: "the shift score saw a shift on the test split, but "}[shift_seen]
    hint = (f"{seen}measured on clean data only, where TTT has little to fix: add --eval_shift "
            f"{example} (or another corruption) to measure it under shift")
    return f"{verdict}; {hint}" if verdict else hint


def _verdict(result: TTTResult, methods: list[str]) -> tuple[str, list[str]]:
    """One line on what adaptation did, and warnings where it hurt."""
    parts, warnings = [], []
    for method in methods:
        clean_change = result.clean[f"accuracy_{method}"] - result.clean["accuracy_source"]
        text = f"{method}: clean {clean_change * 100:+.1f} pt"
        if result.mean_shifted:
            shifted_change = (result.mean_shifted[f"accuracy_{method}"]
                              - result.mean_shifted["accuracy_source"])
            text += f", shifted (mean of {len(result.shifts)}) {shifted_change * 100:+.1f} pt"
            if shifted_change < 0:
                warnings.append(f"{method} lowers mean shifted accuracy by "
                                f"{-shifted_change * 100:.1f} points")
        if clean_change < -0.01:
            warnings.append(f"{method} lowers clean accuracy by {-clean_change * 100:.1f} "
                            "points; try a larger --batch_size or --ttt_bn_prior (e.g. 16)")
        parts.append(text)
    parts += [f"{method} does not apply: {why}" for method, why in result.not_applicable.items()]
    return "; ".join(parts), warnings
