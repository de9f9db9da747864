"""A bundle's three graphs from one trace (tracing.trace_graphs, ttc/convert/graphs.py): the same
operators and the same outputs as three separate exports give, and the Dropout removal that
derives the eval-mode graphs on hand-made graphs (chains, a Dropout as the graph's output, a
read mask)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

NAMES = ["logits", "probabilities"]


def op_types(model: onnx.ModelProto) -> list[str]:
    return [node.op_type for node in model.graph.node]


def probabilities(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session.run(["probabilities"], {"image": x})[0]


def test_one_trace_gives_the_graphs_three_exports_give():
    from ttc.convert.tracing import export_graph, fold_constants, sampling_copy, trace_graphs
    from ttc.serving.bundle import InputSpec

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                              torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Dropout(0.3),
                              torch.nn.Linear(4 * 8 * 8, 3)).eval()
    net[1].running_mean.uniform_(-1, 1)  # statistics a folding mistake would show in outputs
    net[1].running_var.uniform_(0.5, 2)
    spec = InputSpec(name="image", shape=("batch", 1, 8, 8), dtype="float32", padding_id=None,
                     max_length=None, extra_inputs=())
    example = np.zeros((2, 1, 8, 8), dtype=np.float32)
    traced = trace_graphs(net, example, 18, spec, NAMES, temperature=0.7)
    separately = {
        "deployable": export_graph(net, example, 18, spec, NAMES, temperature=0.7),
        "adaptation": fold_constants(export_graph(net, example, 18, spec, NAMES, optimize=False,
                                                  temperature=0.7)),
        "sampling": export_graph(sampling_copy(net), example, 18, spec, NAMES, keep_modes=True,
                                 temperature=0.7)}
    x = np.random.default_rng(1).normal(size=(5, 1, 8, 8)).astype(np.float32)
    for name, expected in separately.items():
        got = getattr(traced, name)
        onnx.checker.check_model(got, full_check=True)
        assert op_types(got) == op_types(expected), name
        # ONNX Runtime's default optimisations drop a training-mode Dropout (EliminateDropout)
        np.testing.assert_array_equal(probabilities(got, x), probabilities(expected, x))
    assert "BatchNormalization" not in op_types(traced.deployable)
    assert "Dropout" not in op_types(traced.deployable) + op_types(traced.adaptation)
    assert op_types(traced.adaptation).count("BatchNormalization") == 1
    assert op_types(traced.sampling).count("Dropout") == 1
    with torch.no_grad():
        expected = torch.softmax(net(torch.from_numpy(x)) / 0.7, dim=1).numpy()
    np.testing.assert_allclose(probabilities(traced.deployable, x), expected, atol=1e-5)


def test_a_network_without_batchnorm_or_dropout_gets_the_deployable_graph_only():
    from ttc.convert.tracing import trace_graphs
    from ttc.serving.bundle import InputSpec

    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3)).eval()
    spec = InputSpec(name="image", shape=("batch", 1, 8, 8), dtype="float32", padding_id=None,
                     max_length=None, extra_inputs=())
    traced = trace_graphs(net, np.zeros((2, 1, 8, 8), np.float32), 18, spec, NAMES, 1.0)
    assert traced.adaptation is None and traced.sampling is None
    assert "Gemm" in op_types(traced.deployable)


def dropout_graph(nodes: list, outputs: list[str]) -> onnx.ModelProto:
    ratio = helper.make_node("Constant", [], ["ratio"], value=helper.make_tensor(
        "r", TensorProto.FLOAT, [], [0.5]))
    mode = helper.make_node("Constant", [], ["mode"], value=helper.make_tensor(
        "m", TensorProto.BOOL, [], [True]))
    graph = helper.make_graph(
        [ratio, mode, *nodes], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT if o != "mask" else TensorProto.BOOL,
                                       [2]) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_dropout_removal_rewires_chains_keeps_output_names_and_refuses_a_read_mask():
    from ttc.convert.graphs import without_dropout

    chain = dropout_graph([helper.make_node("Dropout", ["x", "ratio", "mode"], ["d1"]),
                           helper.make_node("Dropout", ["d1", "ratio", "mode"], ["d2"]),
                           helper.make_node("Relu", ["d2"], ["y"])], ["y"])
    model = without_dropout(chain)
    assert op_types(model) == ["Relu"] and list(model.graph.node[0].input) == ["x"]
    assert op_types(chain) == ["Constant", "Constant", "Dropout", "Dropout", "Relu"]  # a copy
    onnx.checker.check_model(model, full_check=True)
    last = dropout_graph([helper.make_node("Relu", ["x"], ["r"]),
                          helper.make_node("Dropout", ["r", "ratio", "mode"], ["y"])], ["y"])
    model = without_dropout(last)
    assert op_types(model) == ["Relu", "Identity"] and model.graph.output[0].name == "y"
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(["y"], {"x": np.array([-1, 2], np.float32)})[0],
                                  [0, 2])
    masked = dropout_graph([helper.make_node("Dropout", ["x", "ratio", "mode"], ["y", "mask"])],
                           ["y", "mask"])
    assert without_dropout(masked) is None
