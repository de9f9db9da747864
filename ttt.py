"""Test-time training on a deployed ONNX model: BatchNorm re-estimation (`bn`, Schneider et al.
2020) and Tent (`tent`, Wang et al. 2021, after DequanWang/tent), episodic or online.

Both adapt the bundle's adaptation graph (model.bn.onnx: the BatchNorm nodes the deployable graph
folds away), rewritten here so that every BatchNormalization normalises with its input's batch
statistics blended with its stored statistics, w = n / (n + N) for a batch of n samples and a
prior of N samples (--ttt_bn_prior; N = 0: batch statistics only). The blended statistics are
graph outputs; the stored statistics and the affine parameters are graph inputs with the
bundle's values as defaults, so one session.run adapts and predicts and a run can feed other
parameters in (no session is rebuilt, no state lives in the session).

- bn runs in ONNX Runtime only; torch is never imported.
- tent minimises the mean prediction entropy over the BatchNorm affine parameters of a PyTorch
  copy rebuilt from model.pt (Adam, --ttt_iterations steps per batch); the adapted parameters
  are fed into the ONNX graph, which gives the predictions.
- episodic: every batch starts from the bundle's parameters. online: the adapted statistics
  (bn) or parameters (tent) carry over to the next batch, reset every --ttt_reset_every batches
  and, with a WARNING, when the predictions collapse.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from metrics import accuracy, entropy
from runtime import batches_of, best_of
from tta_graph import GraphNodes
from utils import LOG, ConfigError

PRIOR = "ttt_bn_prior"  # graph input: the prior strength N
SOURCE_PRIOR = 1e12  # a prior so strong that the stored statistics win: the unadapted model


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
    """A session of the adaptation graph: a batch and parameters in, probabilities and adapted
    statistics out. Sessions hold no adapted state, so callers can share one."""

    def __init__(self, model: onnx.ModelProto, make_session: Callable[[bytes], object]) -> None:
        self.source = model
        rewritten, self.layers = adaptation_model(model)
        self.session = make_session(rewritten.SerializeToString())
        self.input_name = model.graph.input[0].name
        self.outputs = ["probabilities"] + [n for layer in self.layers
                                            for n in (layer.adapted_mean, layer.adapted_var)]

    def run(self, x: np.ndarray, prior: float, params: dict[str, np.ndarray]
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(probabilities, {stored-statistic name: adapted value}) for one batch."""
        feed = {self.input_name: x, PRIOR: np.array([prior], np.float32), **params}
        probabilities, *stats = self.session.run(self.outputs, feed)
        names = [n for layer in self.layers for n in (layer.mean, layer.var)]
        return probabilities, dict(zip(names, stats))


class Tent:
    """Entropy minimisation over the BatchNorm affine parameters of a PyTorch copy of the
    network, with batch statistics (Wang et al. 2021; configure, collect, adapt, reset as in
    DequanWang/tent's tent.py). `adapt` returns the parameters under the ONNX graph's names."""

    def __init__(self, manifest: dict, weights: Path, layers: list[BNLayer], learning_rate: float,
                 steps: int, num_threads: int = 1) -> None:
        import torch

        from models import load_weights
        from utils import quiet_library_loggers

        quiet_library_loggers()  # importing torch resets some loggers
        if num_threads > 0:
            torch.set_num_threads(num_threads)

        self.torch, self.steps, self.learning_rate = torch, steps, learning_rate
        self.net = load_weights(manifest, weights).eval()
        self.net.requires_grad_(False)
        self.norms = [m for m in self.net.modules()
                      if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        if len(self.norms) != len(layers):
            raise ConfigError(f"model.pt has {len(self.norms)} BatchNorm layers, the adaptation "
                              f"graph {len(layers)}", "re-export the bundle")
        for norm in self.norms:  # batch statistics in the forward, gradients for the affine
            norm.train()
            norm.track_running_stats = False
            norm.running_mean = norm.running_var = None
            norm.requires_grad_(True)
        self.names = [(layer.scale, layer.bias) for layer in layers]
        self.initial = [(n.weight.detach().clone(), n.bias.detach().clone()) for n in self.norms]
        self.reset()

    def reset(self) -> None:
        with self.torch.no_grad():
            for norm, (weight, bias) in zip(self.norms, self.initial):
                norm.weight.copy_(weight)
                norm.bias.copy_(bias)
        params = [p for n in self.norms for p in (n.weight, n.bias)]
        self.optimizer = self.torch.optim.Adam(params, lr=self.learning_rate, betas=(0.9, 0.999))

    def adapt(self, x: np.ndarray) -> dict[str, np.ndarray]:
        batch = self.torch.from_numpy(np.ascontiguousarray(x))
        for _ in range(self.steps):
            log_probs = self.net(batch).log_softmax(1)
            entropy = -(log_probs.exp() * log_probs).sum(1).mean()
            entropy.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
        return self.parameters()

    def parameters(self) -> dict[str, np.ndarray]:
        """The current affine parameters, under the ONNX graph's names."""
        return {name: p.detach().numpy().copy() for norm, names in zip(self.norms, self.names)
                for name, p in zip(names, (norm.weight, norm.bias))}


# ----------------------------------------------------------------------------- running


def ttt_batches(x: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Batches for adaptation; a last batch under half the size joins the one before, because
    statistics of a handful of samples are noise."""
    batches = batches_of(x, batch_size)
    if len(batches) > 1 and len(batches[-1]) < batch_size / 2:
        tail = x[(len(batches) - 2) * batch_size:]
        batches = batches[:-2] + batches_of(tail, len(tail))
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


@dataclass
class OnlineCarry:
    """What online adaptation carries from one call to the next, for callers that see the data
    in chunks (inference.py --input): the adapted statistics and the batch count (tent keeps its
    parameters in its Tent object)."""

    state: dict = field(default_factory=dict)
    batches: int = 0


def adapt_and_predict(graph: AdaptationGraph, method: str, x: np.ndarray, batch_size: int,
                      mode: str, prior: float, reset_every: int, tent: Tent | None = None,
                      carry: OnlineCarry | None = None) -> Adaptation:
    """Run `method` over x batch by batch. Episodic: every batch from the bundle's parameters.
    Online: statistics (bn) or affine parameters (tent) carry over, across calls too when the
    caller passes the same `carry`."""
    carry = carry if carry is not None else OnlineCarry()
    state: dict[str, np.ndarray] = carry.state
    out, resets = [], 0
    for i, batch in enumerate(ttt_batches(x, batch_size), start=carry.batches):
        carry.batches = i + 1
        if mode == "episodic" or (reset_every and i and i % reset_every == 0):
            state = {}
            if tent is not None:
                tent.reset()
        if tent is not None:
            probabilities, _ = graph.run(batch, 0.0, tent.adapt(batch))
        else:
            probabilities, stats = graph.run(batch, prior, state)
            state = stats if mode == "online" else state
        if mode == "online":
            reason = collapse_reason(probabilities,
                                     lambda b=batch: graph.run(b, SOURCE_PRIOR, {})[0])
            if reason:
                LOG.warning("online %s adaptation reset to the bundle's parameters at batch %d: "
                            "%s", method, i + 1, reason)
                state, resets = {}, resets + 1
                if tent is not None:
                    tent.reset()
        out.append(probabilities)
    carry.state = state
    return Adaptation(np.concatenate(out), resets)


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

    @property
    def methods(self) -> list[str]:
        return ["bn", "tent"] if self.method == "all" else [self.method]


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
    warnings: list[str] = field(default_factory=list)

    def report_section(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "warnings"}


TIMING_PASSES = 3


def evaluate_ttt(settings: TTTSettings, graph: AdaptationGraph, predict: Callable,
                 tent: Tent | None, x: np.ndarray, y: np.ndarray, preprocessing: dict
                 ) -> TTTResult:
    """Accuracy without adaptation and with each method, on the clean test split and on every
    corrupted copy of it; cost = adaptation time / plain inference time on the same batches."""
    from shifts import corrupt

    cases = [("clean", 0, x)] + [(name, settings.severity,
                                  corrupt(x, name, settings.severity, preprocessing, settings.seed))
                                 for name in settings.shifts]
    rows, resets = [], {m: 0 for m in settings.methods}
    graph.run(x[: settings.batch_size], 0.0, {})  # warm-up both: first runs allocate
    predict(x[: settings.batch_size])
    if tent is not None:
        tent.adapt(x[: settings.batch_size])
        tent.reset()
    for name, severity, data in cases:
        batches = ttt_batches(data, settings.batch_size)
        plain_seconds, plain = best_of(TIMING_PASSES, lambda: np.concatenate(
            [predict(b) for b in batches]))
        row = {"name": name, "severity": severity, "accuracy_source": accuracy(plain, y),
               "accuracy_bn": None, "accuracy_tent": None, "cost_ratio_bn": None,
               "cost_ratio_tent": None}
        for method in settings.methods:
            tent_or_none = tent if method == "tent" else None
            passes = 1 if method == "tent" else TIMING_PASSES  # tent's torch steps dominate
            seconds, adapted = best_of(passes, lambda: adapt_and_predict(
                graph, method, data, settings.batch_size, settings.mode, settings.bn_prior,
                settings.reset_every, tent_or_none))
            row[f"accuracy_{method}"] = accuracy(adapted.probabilities, y)
            row[f"cost_ratio_{method}"] = round(seconds / max(plain_seconds, 1e-9), 3)
            resets[method] += adapted.resets
        LOG.info("ttt %s%s: source %.4f%s", name, f" (severity {severity})" if severity else "",
                 row["accuracy_source"], "".join(f", {m} {row[f'accuracy_{m}']:.4f}"
                                                 for m in settings.methods))
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
                       shifted, mean_shifted, resets)
    result.verdict, result.warnings = _verdict(result, settings.methods)
    return result


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
    return "; ".join(parts), warnings
