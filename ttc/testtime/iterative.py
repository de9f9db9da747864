"""Iterative inference: several forward passes per input, and what they buy.

- MC-dropout: K stochastic passes through the bundle's MC graph (model.mc.onnx: Dropout kept in
  training mode), run with ONNX Runtime's EliminateDropout disabled; each Dropout node gets a
  seed from --seed, so a run is reproducible. Three backends give the same distribution:
  `python` (a loop of session.run over the whole graph, with early stopping), `batched` (K
  copies stacked along the batch axis in one run) and `loop` (the K passes inside the graph, an
  ONNX Loop, one run); these two run the part before the first Dropout once.
  The passes are taken from the graph's logits (softmax at T = 1), so that their mean can be
  rescaled by its own temperature (calibrate.py).
- Ensembles: several bundles' graphs merged into one graph that returns every member's
  softmax(logits) and their mean, rescaled by the ensemble's temperature where it has one.
- State feedback: a graph with a `state` input and a `state_out` output is run N times, each
  pass fed the state the last one returned (zeros at first).
- Calibration: negative log-likelihood, expected calibration error and accuracy when abstaining
  on the most uncertain inputs, for the single pass and each of the above.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from ttc.testtime.calibrate import LOG_FLOOR
from ttc.reporting.evaluation import reliability
from ttc.reporting.metrics import accuracy, accuracy_at_coverage, entropy, expected_calibration_error, nll
from ttc.inputs.preprocess import PADDING_ID_KEY
from ttc.testtime.tta_graph import GraphNodes
from utils import LOG, ConfigError

PASSES_OUTPUT = "pass_probabilities"  # (passes, N, classes)
MC_SESSION_ARGS = {"disabled_optimizers": ["EliminateDropout"]}

# ----------------------------------------------------------------------------- graphs


def seeded_dropout(model: onnx.ModelProto, seed: int) -> onnx.ModelProto:
    """A copy whose Dropout nodes each draw from their own seed (seed, seed+1, ...)."""
    out = copy.deepcopy(model)
    dropouts = [n for n in out.graph.node if n.op_type == "Dropout"]
    if not dropouts:
        raise ConfigError("the MC graph has no Dropout node", "re-export the bundle")
    for k, node in enumerate(dropouts):
        kept = [a for a in node.attribute if a.name != "seed"]
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute("seed", int(seed + k))])
    return out


def _finish(model: onnx.ModelProto, outputs: list[tuple[str, list]]) -> onnx.ModelProto:
    del model.graph.output[:]
    model.graph.output.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
                              for name, shape in outputs)
    del model.graph.value_info[:]
    onnx.checker.check_model(model)
    return model


def runtime_inputs(graph: onnx.GraphProto) -> list[str]:
    """The inputs a run feeds (an hf graph's input_ids, attention_mask, token_type_ids), not
    the initializers a graph may also list as inputs."""
    initializers = {i.name for i in graph.initializer}
    return [i.name for i in graph.input if i.name not in initializers]


def shared_prefix(model: onnx.ModelProto) -> tuple[int, str | None]:
    """Where the passes can start: (index of the first Dropout node, its input tensor). Nothing
    before the first Dropout is random, so that part runs once and only the rest K times; the
    digits CNN's Dropout sits after all its convolutions. If a node after it reads a tensor made
    before it (other than constants) or a graph input (an hf graph's attention mask), the passes
    start at the graph inputs: (0, None)."""
    nodes = list(model.graph.node)
    first = next(i for i, n in enumerate(nodes) if n.op_type == "Dropout")
    start = nodes[first].input[0]
    made_before = {o for n in nodes[:first] if n.op_type != "Constant" for o in n.output}
    made_before.update(runtime_inputs(model.graph))
    for node in nodes[first:]:
        if any(name in made_before and name != start for name in node.input):
            return 0, None
    return first, start


def batched_passes_model(model: onnx.ModelProto, passes: int, classes: int) -> onnx.ModelProto:
    """K copies stacked along the batch axis where the passes start (shared_prefix: the first
    Dropout's input, or every graph input), the rest of the model run once over them, the
    probabilities reshaped to (K, N, classes)."""
    out = copy.deepcopy(model)
    graph = out.graph
    first, start = shared_prefix(out)
    nodes = GraphNodes("mc_batched")
    starts = [start] if start is not None else runtime_inputs(graph)
    stacked = {name: nodes.op("Concat", [name] * passes, axis=0) for name in starts}
    for node in list(graph.node)[first:]:
        node.input[:] = [stacked.get(n, n) for n in node.input]
    tail = GraphNodes("mc_tail")
    rows = tail.op("Softmax", ["logits"], axis=-1)
    tail.op("Reshape", [rows, tail.const([passes, -1, classes])], output=PASSES_OUTPUT)
    model_nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(model_nodes[:first] + nodes.nodes + model_nodes[first:] + tail.nodes)
    graph.initializer.extend(nodes.initializers + tail.initializers)
    return _finish(pruned(out, [PASSES_OUTPUT]), [(PASSES_OUTPUT, [passes, "batch", classes])])


def loop_passes_model(model: onnx.ModelProto, passes: int, classes: int) -> onnx.ModelProto:
    """The K passes inside the graph: the shared prefix once, then an ONNX Loop whose body is
    the rest of the model (reading the prefix's output and the weights from the outer scope)
    and whose scan output stacks each pass's probabilities into (K, N, classes)."""
    out = copy.deepcopy(model)
    graph = out.graph
    first, _ = shared_prefix(out)
    model_nodes = list(graph.node)
    body_nodes = model_nodes[first:]
    body_nodes.append(helper.make_node("Identity", ["loop_cond_in"], ["loop_cond_out"]))
    body_nodes.append(helper.make_node("Softmax", ["logits"], ["loop_scan"], axis=-1))
    body = helper.make_graph(
        body_nodes, "mc_pass",
        [helper.make_tensor_value_info("loop_iteration", TensorProto.INT64, []),
         helper.make_tensor_value_info("loop_cond_in", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("loop_cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("loop_scan", TensorProto.FLOAT, None)])
    outer = GraphNodes("mc_loop")
    count = outer.const(np.array(passes, dtype=np.int64))
    keep_going = outer.const(np.array(True), dtype=bool)
    outer.op("Loop", [count, keep_going], output=PASSES_OUTPUT, body=body)
    del graph.node[:]
    graph.node.extend(model_nodes[:first] + outer.nodes)
    graph.initializer.extend(outer.initializers)
    kept = pruned_nodes(list(body.node), {"loop_cond_out", "loop_scan"})
    del body.node[:]
    body.node.extend(kept)
    return _finish(out, [(PASSES_OUTPUT, [passes, "batch", classes])])


def pruned_nodes(nodes: list[onnx.NodeProto], wanted: set[str]) -> list[onnx.NodeProto]:
    """The nodes `wanted` outputs depend on (a pass graph's probabilities, which bake the
    single model's temperature, are not: the passes are averaged from their logits)."""
    live, kept = set(wanted), []
    for node in reversed(nodes):
        if any(name in live for name in node.output):
            kept.append(node)
            live.update(node.input)
            live.update(_subgraph_reads(node))
    return kept[::-1]


def _subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Names a Loop or If body reads, from the outer scope among them."""
    reads: set[str] = set()
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            for inner in attribute.g.node:
                reads.update(inner.input)
                reads.update(_subgraph_reads(inner))
    return reads


def pruned(model: onnx.ModelProto, wanted: Sequence[str]) -> onnx.ModelProto:
    kept = pruned_nodes(list(model.graph.node), set(wanted))
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return model


def member_nodes(members: Sequence[onnx.ModelProto], output: str
                 ) -> tuple[list, list, list[str]]:
    """Every member's nodes and initializers, prefixed member{k}_, reading the first member's
    runtime inputs (shared by all), and the name of each member's `output` in them: the body of
    a graph that runs an ensemble in one session."""
    sources = runtime_inputs(members[0].graph)
    nodes, initializers, stacked = [], [], []
    for k, member in enumerate(members):
        prefixed = onnx.compose.add_prefix(member, f"member{k}_")
        shared = {f"member{k}_{name}": name for name in sources}
        for node in prefixed.graph.node:
            node.input[:] = [shared.get(n, n) for n in node.input]
        nodes += list(prefixed.graph.node)
        initializers += list(prefixed.graph.initializer)
        stacked.append(f"member{k}_{output}")
    return nodes, initializers, stacked


def ensemble_model(members: Sequence[onnx.ModelProto], classes: int,
                   temperature: float = 1.0) -> onnx.ModelProto:
    """One graph running every member on the shared inputs (all of an hf graph's: input_ids,
    attention_mask, token_type_ids): outputs each member's softmax(logits) stacked (members, N,
    classes), uncalibrated whatever temperature the member bakes in, and their mean rescaled by
    `temperature` ("probabilities": softmax(log(mean) / T), calibrate.rescale; the plain mean
    at T = 1). The first member's metadata travels along (an hf graph's padding id, by which
    runtime.graph_feeder builds the attention mask)."""
    first = members[0]
    sources = runtime_inputs(first.graph)
    opsets = {(o.domain, o.version) for m in members for o in m.opset_import}
    if len({d for d, _ in opsets}) != len(opsets):
        raise ConfigError("the ensemble members were exported with different opsets",
                          "re-export them with the same --opset")
    for k, member in enumerate(members):
        _require_same_inputs(k, member, first)
    nodes, initializers, stacked = member_nodes(members, "logits")
    tail = GraphNodes("ensemble")
    axis = tail.const([0])
    rows = [tail.op("Unsqueeze", [tail.op("Softmax", [name], axis=-1), axis]) for name in stacked]
    tail.op("Concat", rows, output=PASSES_OUTPUT, axis=0)
    mean = tail.op("ReduceMean", [PASSES_OUTPUT, axis], keepdims=0)
    if temperature == 1.0:
        tail.op("Identity", [mean], output="probabilities")
    else:
        floor = tail.const(LOG_FLOOR, np.float32)
        scores = tail.op("Log", [tail.op("Max", [mean, floor])])
        scaled = tail.op("Div", [scores, tail.const(temperature, np.float32)])
        tail.op("Softmax", [scaled], output="probabilities", axis=-1)
    inputs = [copy.deepcopy(i) for i in first.graph.input if i.name in sources]
    nodes = pruned_nodes(nodes + tail.nodes, {"probabilities", PASSES_OUTPUT})
    graph = helper.make_graph(nodes, "ensemble", inputs, [],
                              initializers + tail.initializers)
    model = helper.make_model(graph, opset_imports=list(first.opset_import),
                              ir_version=first.ir_version)
    model.metadata_props.extend(copy.deepcopy(p) for p in first.metadata_props)
    return _finish(model, [("probabilities", ["batch", classes]),
                           (PASSES_OUTPUT, [len(members), "batch", classes])])


def _require_same_inputs(k: int, member: onnx.ModelProto, first: onnx.ModelProto) -> None:
    """Members share their inputs: the same names, and for hf graphs the same padding id (the
    one attention mask fed to all of them). ConfigError (exit 2) otherwise."""
    names, expected = runtime_inputs(member.graph), runtime_inputs(first.graph)
    if names != expected:
        raise ConfigError(f"ensemble member {k + 1} takes inputs {names}, the first {expected}",
                          "ensemble bundles of the same model type and architecture family")
    padding = [{p.key: p.value for p in m.metadata_props}.get(PADDING_ID_KEY)
               for m in (member, first)]
    if padding[0] != padding[1]:
        raise ConfigError(f"ensemble member {k + 1} pads with id {padding[0]}, the first with "
                          f"{padding[1]}", "ensemble bundles with the same tokenizer")


# ----------------------------------------------------------------------------- running


@dataclass
class Passes:
    """Per-pass probabilities of a split, (passes, N, classes), and how many passes ran
    (a mean over batches when early stopping ended some sooner)."""

    probabilities: np.ndarray
    passes_used: float

    @property
    def mean(self) -> np.ndarray:
        return self.probabilities.mean(0)

    @property
    def std(self) -> np.ndarray:
        return self.probabilities.std(0)


def python_loop(run: Callable[[np.ndarray], np.ndarray], batch: np.ndarray, passes: int,
                tol: float | None, patience: int) -> np.ndarray:
    """session.run `passes` times; with `tol`, stop once the running mean's top-1 is unchanged
    and its largest change below tol for `patience` passes in a row."""
    outs = [run(batch)]
    total, calm = outs[0].astype(np.float64), 0
    while len(outs) < passes:
        probabilities = run(batch)
        outs.append(probabilities)
        previous = total / (len(outs) - 1)
        total = total + probabilities
        current = total / len(outs)
        if tol is not None:
            steady = (current.argmax(1) == previous.argmax(1)).all()
            calm = calm + 1 if steady and np.abs(current - previous).max() < tol else 0
            if calm >= patience:
                break
    return np.stack(outs)


@dataclass
class MCSampler:
    """MC-dropout over batches with one backend. `run` comes from a session of the graph the
    backend needs: the seeded MC graph (python), its batched form or its Loop form."""

    backend: str
    passes: int
    run: Callable[[np.ndarray], np.ndarray]
    tol: float | None = None
    patience: int = 2

    def __call__(self, batches: Sequence[np.ndarray]) -> Passes:
        outs, used = [], []
        for batch in batches:
            if self.backend == "python":
                stacked = python_loop(self.run, batch, self.passes, self.tol, self.patience)
            else:
                stacked = self.run(batch)
            used.append(len(stacked))
            outs.append(stacked)
        # early stopping may leave batches with fewer passes: pad with their own mean
        most = max(used)
        padded = [np.concatenate([s, np.repeat(s.mean(0, keepdims=True), most - len(s), 0)])
                  for s in outs]
        return Passes(np.concatenate(padded, axis=1), float(np.average(
            used, weights=[b.shape[1] for b in outs])))


def mc_model_for(backend: str, mc_model: onnx.ModelProto, passes: int, classes: int, seed: int
                 ) -> onnx.ModelProto:
    seeded = seeded_dropout(mc_model, seed)
    if backend == "batched":
        return batched_passes_model(seeded, passes, classes)
    if backend == "loop":
        return loop_passes_model(seeded, passes, classes)
    return seeded


# ----------------------------------------------------------------------------- calibration


def calibration_row(variant: str, probabilities: np.ndarray, y: np.ndarray, seconds: float,
                    single_seconds: float, passes_used: float,
                    uncertainty: np.ndarray | None = None,
                    temperature: float | None = None) -> dict:
    """A variant's figures on the test split; `temperature`: the one a "+T" variant applies."""
    uncertainty = entropy(probabilities) if uncertainty is None else uncertainty
    return {"variant": variant, "temperature": temperature,
            "accuracy": accuracy(probabilities, y),
            "nll": nll(probabilities, y), "ece": expected_calibration_error(probabilities, y),
            "mean_confidence": float(probabilities.max(1).mean()),
            "accuracy_at_90_coverage": accuracy_at_coverage(probabilities, y, uncertainty),
            "passes_used": passes_used,
            "cost_ratio": round(seconds / max(single_seconds, 1e-9), 3),
            "reliability": reliability(probabilities, y)}


def calibration_verdict(single: dict, other: dict, interval: tuple[float, float],
                        samples: int) -> str:
    """What the extra passes bought in calibration, judged against the bootstrap interval of
    the ECE change, and why when they made it worse."""
    name, low, high = other["variant"], *interval
    change = (f"ECE {single['ece']:.4f} -> {other['ece']:.4f} (90% bootstrap interval of the "
              f"change [{low:+.4f}, {high:+.4f}] on {samples} test samples)")
    if high < 0:
        return f"{name} lowers {change} at {other['cost_ratio']:.2f}x the time of a single pass"
    averaged = {"mc_dropout": "passes", "ensemble": "members"}.get(name)
    why = ""
    if averaged and other["ece"] > single["ece"] and single["mean_confidence"] < single["accuracy"]:
        why = (f"; the single pass is already underconfident (mean confidence "
               f"{single['mean_confidence']:.4f} below accuracy {single['accuracy']:.4f}) and "
               f"averaging {averaged} lowers confidence further")
    if low > 0:
        return f"{name} is less well calibrated than a single pass: {change}{why}"
    return (f"{name} shows no calibration gain this test split can detect: {change} spans 0"
            f"{why}")


def log_rows(rows: list[dict]) -> None:
    for row in rows:
        LOG.info("%s: accuracy %.4f, NLL %.4f, ECE %.4f, accuracy at 90%% coverage %.4f, "
                 "%.3gx the time", row["variant"], row["accuracy"], row["nll"], row["ece"],
                 row["accuracy_at_90_coverage"], row["cost_ratio"])
