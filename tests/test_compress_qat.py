"""Quantization-aware training (ttc/compress/qat.py) on tiny networks: the QDQ graph it exports,
the integer kernels ONNX Runtime runs of it, its agreement with the frozen fake-quantized
network, the training-loop contract, and the networks it refuses."""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from ttc.compress import qat  # first: registers the quantize ops before any export
from ttc.convert import tracing
from ttc.nets.hf import HFTextNet
from ttc.nets.models import SmallCNN, TabularMLP, TextCNN, UserNetwork, user_architecture
from ttc.serving.manifest import InputSpec
from utils import ConfigError, ExportError, TrainingError

OUTPUTS = ["logits", "probabilities"]
# Fake quantization in PyTorch and ONNX Runtime's integer kernels round the same activations
# the same way except at ties and where accumulation order differs: a rounding step here and
# there, well below this on these networks (measured: at most 5e-3 on sklearn's digits).
PROBABILITY_ATOL = 0.02
MIN_AGREEMENT = 0.98
SPEC = InputSpec(name="image", shape=("batch", 1, 8, 8), dtype="float32")


def fine_tune(net: nn.Module, x: torch.Tensor, y: torch.Tensor, passes: int = 2,
              batch: int = 16) -> nn.Module:
    """The normal training loop's contract: net(x) → logits, backward, an optimizer on
    .parameters()."""
    optimizer = torch.optim.AdamW(net.parameters(), 1e-3)
    net.train()
    for _ in range(passes):
        for i in range(0, len(x), batch):
            loss = F.cross_entropy(net(x[i:i + batch]), y[i:i + batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return net


def qdq_graph(qat_net: nn.Module, x: torch.Tensor, spec: InputSpec) -> onnx.ModelProto:
    exporter = functools.partial(tracing.export_graph, opset=18, input_spec=spec,
                                 output_names=OUTPUTS)
    graph = tracing.slim_graph(qat.export_qdq(qat_net, x[:4].numpy(), exporter))
    tracing.check_graph(graph)
    return graph


def onnx_probabilities(graph: onnx.ModelProto, name: str, x: np.ndarray,
                       batch: int) -> np.ndarray:
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, {name: x[i:i + batch]})[1]
                           for i in range(0, len(x), batch)])


def torch_probabilities(net: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return torch.softmax(net(torch.from_numpy(x)), dim=-1).numpy()


def assert_onnx_matches(graph: onnx.ModelProto, frozen: nn.Module, name: str,
                        x: np.ndarray) -> None:
    """At batch 1 and an odd batch: probabilities within PROBABILITY_ATOL, the same top-1."""
    expected = torch_probabilities(frozen, x)
    for batch in (1, 7):
        got = onnx_probabilities(graph, name, x, batch)
        assert np.abs(got - expected).max() < PROBABILITY_ATOL
        assert (got.argmax(1) == expected.argmax(1)).mean() >= MIN_AGREEMENT


def banded_images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8x8 images whose label is the brightest of three horizontal bands."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 8, 8, generator=generator)
    bands = torch.stack([x[:, 0, rows].mean(dim=(1, 2)) for rows in
                         (slice(0, 3), slice(3, 5), slice(5, 8))], dim=1)
    return x, bands.argmax(1)


@pytest.fixture(scope="module")
def cnn() -> dict:
    """A SmallCNN with its input statistics, prepared for QAT, fine-tuned, frozen, exported."""
    torch.manual_seed(0)
    net = SmallCNN(in_channels=1, num_classes=3, widths=[8, 16], mean=[0.5], std=[0.29])
    x, y = banded_images(64, seed=1)
    fine_tune(net, x, y, passes=1)
    qat_net = fine_tune(qat.prepare_qat(net.eval(), x[:32]), x, y)
    frozen = qat.frozen_for_export(qat_net)
    return {"net": net, "qat": qat_net, "frozen": frozen, "graph": qdq_graph(qat_net, x, SPEC),
            "x": x, "checked": banded_images(35, seed=2)[0].numpy()}


def test_every_conv_and_gemm_is_quantized_and_runs_as_an_integer_kernel(cnn):
    graph = cnn["graph"]
    structure = qat.require_integer_kernels(graph)
    assert structure["weighted_ops"] == structure["quantized_weighted_ops"] == 5
    assert structure["quantize_linear"] >= 5 and structure["dequantize_linear"] >= 10
    assert structure["integer_kernels"].get("QLinearConv") == 4  # Conv-BN-ReLU, BN folded
    assert structure["integer_kernels"].get("QGemm") == 1  # the classifier, float logits out
    assert structure["float_weighted_ops"] == 0
    assert not any(n.op_type == "BatchNormalization" for n in graph.graph.node)
    # the weights are stored as int8 (biases int32), each read through a DequantizeLinear
    initializers = {i.name: i for i in graph.graph.initializer}
    for node in graph.graph.node:
        if node.op_type in ("Conv", "Gemm"):
            dequantize = next(n for n in graph.graph.node if node.input[1] in n.output)
            assert dequantize.op_type == "DequantizeLinear"
            assert initializers[dequantize.input[0]].data_type == TensorProto.INT8
    # the network's own preprocessing stays in the graph, in float, before the first quantization
    subtract = next(n for n in graph.graph.node if n.op_type == "Sub")
    divide = next(n for n in graph.graph.node if n.op_type == "Div")
    assert subtract.input[0] == "image" and divide.input[0] == subtract.output[0]
    assert next(n for n in graph.graph.node if divide.output[0] in n.input).op_type \
        == "QuantizeLinear"


def test_onnx_runtime_agrees_with_the_frozen_fake_quantized_network(cnn):
    assert_onnx_matches(cnn["graph"], cnn["frozen"], "image", cnn["checked"])
    # freezing (BatchNorm folded, ranges fixed) leaves the QAT network's eval outputs alone
    qat_net = copy.deepcopy(cnn["qat"]).eval()
    x = torch.from_numpy(cnn["checked"])
    with torch.no_grad():
        assert torch.allclose(qat_net(x), cnn["frozen"](x), atol=1e-4)


def test_the_qat_network_fits_the_training_loop(cnn):
    qat_net = copy.deepcopy(cnn["qat"])  # the trainer deep-copies programs
    assert qat_net.training
    assert torch.equal(qat_net.mean, cnn["net"].mean) and torch.equal(qat_net.std, cnn["net"].std)
    ranges = {k: v.clone() for k, v in qat_net.state_dict().items() if k.endswith("scale")}
    x = cnn["x"][:8]
    qat_net.eval()  # evaluating twice: the same logits, the ranges unmoved
    with torch.no_grad():
        assert torch.equal(qat_net(x), qat_net(x))
    assert all(torch.equal(qat_net.state_dict()[k], v) for k, v in ranges.items())
    # weights saved and loaded into a freshly prepared network give the same network
    again = qat.prepare_qat(cnn["net"].eval(), cnn["x"][:8])
    again.load_state_dict(qat_net.state_dict())
    with torch.no_grad():
        assert torch.equal(again.eval()(x), qat_net(x))
    # a fine-tuning that diverged is not exported
    next(m for m in again.modules() if hasattr(m, "scale")).scale.fill_(float("nan"))
    with pytest.raises(TrainingError) as diverged:
        qat.frozen_for_export(again)
    assert "diverged" in str(diverged.value) and diverged.value.exit_code == 4


def test_tables_keep_their_imputation_and_standardisation():
    torch.manual_seed(0)
    net = TabularMLP(num_features=5, num_classes=2, hidden=[16, 8], median=[0.5] * 5,
                     mean=[1.0, 0.0, -1.0, 2.0, 0.5], std=[2.0, 1.0, 0.5, 3.0, 1.0])
    x = torch.randn(64, 5) * 2
    y = (x[:, 0] + x[:, 1] > 0).long()
    qat_net = fine_tune(qat.prepare_qat(net.eval(), x[:32]), x, y)
    assert torch.equal(qat_net.median, net.median) and torch.equal(qat_net.std, net.std)
    spec = InputSpec(name="features", shape=("batch", 5), dtype="float32")
    graph = qdq_graph(qat_net, x, spec)
    structure = qat.require_integer_kernels(graph)
    assert structure["integer_kernels"].get("QGemm") == 3  # Linear-BN fused, then the head
    assert structure["weighted_ops"] == structure["quantized_weighted_ops"] == 3
    checked = torch.randn(35, 5).numpy() * 2
    checked[::3, 2] = np.nan  # missing: imputed with the median inside the graph
    assert_onnx_matches(graph, qat.frozen_for_export(qat_net), "features", checked)


def test_text_keeps_its_embedding_float_and_its_dynamic_length():
    torch.manual_seed(0)
    net = TextCNN(vocab_size=40, num_classes=2, embedding_dim=8, kernel_sizes=[2, 3], filters=6)
    ids = torch.randint(1, 40, (64, 9))
    ids[:, 6:][torch.rand(64, 3) < 0.5] = 0  # right padding
    y = (ids[:, 0] > 20).long()
    qat_net = fine_tune(qat.prepare_qat(net.eval(), ids[:32]), ids, y)
    spec = InputSpec(name="token_ids", shape=("batch", "length"), dtype="int64", padding_id=0)
    graph = qdq_graph(qat_net, ids, spec)
    structure = qat.require_integer_kernels(graph)
    assert structure["quantized_gathers"] == 0
    assert structure["integer_kernels"].get("QLinearConv") == 2
    assert structure["integer_kernels"].get("QGemm") == 1
    gather = next(n for n in graph.graph.node if n.op_type == "Gather")
    table = next(i for i in graph.graph.initializer if i.name == gather.input[0])
    assert table.data_type == TensorProto.FLOAT  # looked up as trained, never dequantized
    frozen = qat.frozen_for_export(qat_net)
    checked = ids[:35].numpy()
    assert_onnx_matches(graph, frozen, "token_ids", checked)
    padded = np.pad(checked, ((0, 0), (0, 3)))  # a longer batch: same graph, same answers
    assert_onnx_matches(graph, frozen, "token_ids", padded)
    assert np.abs(onnx_probabilities(graph, "token_ids", padded, 7)
                  - onnx_probabilities(graph, "token_ids", checked, 7)).max() < 1e-6


class HFLike(HFTextNet):
    """An HFTextNet without a Hugging Face model behind it."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.head = nn.Linear(4, 2)


UNTRACEABLE = '''
from torch import nn

class Branchy(nn.Module):
    def __init__(self, width, classes):
        super().__init__()
        self.a, self.b = nn.Linear(width, classes), nn.Linear(width, classes)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else self.b(x)

def build(num_classes, input_spec):
    return Branchy(input_spec["num_features"], num_classes)
'''


def test_networks_without_a_qat_path_are_refused_with_the_reason(tmp_path: Path):
    reason = qat.qat_unsupported_reason(HFLike())
    assert "hf:" in reason and "--quantize dynamic" in reason
    source = tmp_path / "branchy.py"
    source.write_text(UNTRACEABLE, encoding="utf-8")
    preprocessing = {"kind": "tabular", "feature_names": ["a", "b", "c"]}
    user = UserNetwork(**user_architecture(source, "build", preprocessing, 2))
    reason = qat.qat_unsupported_reason(user)
    assert reason.startswith("torch.fx cannot trace the network")
    assert "control flow" in reason and "\n" not in reason
    assert "no Conv1d, Conv2d or Linear" in qat.qat_unsupported_reason(nn.Sequential(nn.ReLU()))
    assert qat.qat_unsupported_reason(SmallCNN(1, 3, [8])) is None
    with pytest.raises(ConfigError) as refused:
        qat.prepare_qat(user, torch.zeros(2, 3))
    assert refused.value.exit_code == 2


def float_graph(quantized_table: bool) -> onnx.ModelProto:
    """x @ W in float (no integer kernel possible), or a Gather from a dequantized table."""
    if quantized_table:
        nodes = [helper.make_node("DequantizeLinear", ["table", "scale"], ["dq"]),
                 helper.make_node("Gather", ["dq", "x"], ["y"])]
        inputs = [helper.make_tensor_value_info("x", TensorProto.INT64, ["n"])]
        initializers = [numpy_helper.from_array(np.ones((5, 3), np.uint8), "table"),
                        numpy_helper.from_array(np.float32(0.1), "scale")]
    else:
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5])]
        initializers = [numpy_helper.from_array(np.ones((5, 3), np.float32), "w")]
    graph = helper.make_graph(nodes, "g", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("quantized_table, phrase", [(False, "none of the QAT graph's 1"),
                                                     (True, "embedding table")])
def test_a_graph_onnx_runtime_would_not_run_in_int8_is_refused(quantized_table, phrase):
    with pytest.raises(ExportError) as refused:
        qat.require_integer_kernels(float_graph(quantized_table))
    assert phrase in str(refused.value) and refused.value.exit_code == 4
