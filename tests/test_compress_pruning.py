"""Structured channel pruning (ttc/compress/pruning.py): tiny networks pruned by Torch-Pruning
become smaller dense networks whose ONNX graphs run as they do in torch, and a bundle's record
(fresh network + shapes + state dict) rebuilds them exactly."""
from __future__ import annotations

import copy
import json
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from ttc.compress.pruning import (CHANNEL_MULTIPLE, count_macs, count_params, kept_channels,
                                  prune_channels, prune_unsupported_reason, resized_to,
                                  shapes_of)
from ttc.nets.hf import HFTextNet
from ttc.nets.models import (SmallCNN, TabularMLP, TabularResMLP, TextCNN, TextTransformer,
                             TorchvisionNet)
from ttc.serving.bundle import InputSpec

RATIO = 0.4


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny convolutions: torch's thread pool only contends with the other xdist worker."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pixels(n: int = 4, side: int = 8) -> torch.Tensor:
    return torch.rand(n, 1, side, side, generator=torch.Generator().manual_seed(0))


def features() -> torch.Tensor:
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    x[0, 1] = x[3, 4] = float("nan")  # missing values: imputed by the network
    return x


def token_ids() -> torch.Tensor:
    ids = torch.randint(1, 50, (4, 12), generator=torch.Generator().manual_seed(0))
    ids[0, 5:] = ids[1, 9:] = 0  # right padding
    return ids


def with_statistics(net: nn.Module) -> nn.Module:
    """Random BatchNorm statistics, so that a rebuild that loses them shows in the outputs."""
    torch.manual_seed(1)
    for module in net.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return net.eval()


NETWORKS = {
    "small_cnn": (lambda: SmallCNN(in_channels=1, num_classes=3, widths=[8, 16]), pixels),
    "tabular_mlp": (lambda: TabularMLP(num_features=5, num_classes=2, hidden=[16, 8]), features),
    "tabular_resmlp": (lambda: TabularResMLP(num_features=5, num_classes=2, width=16),
                       features),
    "text_cnn": (lambda: TextCNN(vocab_size=50, num_classes=2, embedding_dim=16, filters=8),
                 token_ids),
    "text_transformer": (lambda: TextTransformer(vocab_size=50, num_classes=2, max_positions=16,
                                                 d_model=16, heads=4, feedforward=32),
                         token_ids),
    "resnet18": (lambda: TorchvisionNet("resnet18", in_channels=1, num_classes=3,
                                        small_stem=True), lambda: pixels(2, 16)),
    "mobilenet_v3_small": (lambda: TorchvisionNet("mobilenet_v3_small", in_channels=1,
                                                  num_classes=3, small_stem=True),
                           lambda: pixels(2, 16)),
}


def labels_for(x: torch.Tensor, classes: int) -> torch.Tensor:
    return torch.arange(len(x)) % classes


def no_fine_tuning(net: nn.Module, step: int) -> nn.Module:
    return net


def out_channels(net: nn.Module) -> dict[str, int]:
    return {name: m.weight.shape[0] for name, m in net.named_modules()
            if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear))}


# ----------------------------------------------------------------------------- pruning


def test_each_layer_loses_the_ratio_of_its_channels_head_and_stem_kept():
    net = with_statistics(SmallCNN(in_channels=1, num_classes=3, widths=[8, 16]))
    original = copy.deepcopy(net.state_dict())
    steps_seen = []

    def fine_tune(pruned: nn.Module, step: int) -> nn.Module:
        steps_seen.append(step)
        return pruned

    result = prune_channels(net, pixels(), RATIO, 3, "l2", fine_tune)
    pruned = result.net
    assert steps_seen == [0, 1, 2]
    # floor(8 × 0.6) = 4, floor(16 × 0.6) = 9 (too few channels to round to multiples of 16)
    assert out_channels(pruned) == {"features.0": 4, "features.3": 4, "features.7": 9,
                                    "features.10": 9, "classifier": 3}
    assert pruned.features[0].in_channels == 1 and pruned.classifier.in_features == 9
    assert result.channels == {"features.0": [8, 4], "features.3": [8, 4],
                               "features.7": [16, 9], "features.10": [16, 9]}
    assert result.params_after == count_params(pruned) < result.params_before
    assert result.params_before == count_params(net)
    assert result.removed == pytest.approx(1 - 26 / 48)
    assert result.macs_after == count_macs(pruned, pixels()) < result.macs_before
    assert (result.ratio, result.steps, result.importance) == (RATIO, 3, "l2")
    json.dumps(result.report_section())
    assert all(torch.equal(v, original[k]) for k, v in net.state_dict().items())  # untouched
    assert pruned(pixels()).shape == (4, 3)


def test_each_step_continues_from_the_network_fine_tuning_returns():
    """The trainer returns a copy (its best epoch): the next step prunes that copy's weights."""
    net = with_statistics(TabularMLP(num_features=5, num_classes=2, hidden=[16, 8]))
    copies = []

    def fine_tune(pruned: nn.Module, step: int) -> nn.Module:
        tuned = copy.deepcopy(pruned)
        with torch.no_grad():
            tuned.classifier.bias.fill_(float(step + 1))
        copies.append(tuned)
        return tuned

    result = prune_channels(net, features(), RATIO, 2, "l2", fine_tune)
    assert len(copies) == 2
    assert torch.equal(result.net.classifier.bias, torch.full((2,), 2.0))
    assert out_channels(result.net) == {"body.0": 9, "body.4": 4, "classifier": 2}
    assert not torch.isnan(result.net(features())).any()


def test_taylor_importance_uses_gradients_of_the_given_batches():
    net = with_statistics(SmallCNN(in_channels=1, num_classes=3, widths=[8, 16]))
    x = pixels(12)
    calls = []

    def batches():
        calls.append(1)
        yield x, labels_for(x, 3)

    taylor = prune_channels(net, pixels(), RATIO, 2, "taylor", no_fine_tuning, batches)
    assert len(calls) == 2  # gradients before each step
    assert out_channels(taylor.net)["features.7"] == 9
    assert all(p.grad is None for p in taylor.net.parameters())
    with pytest.raises(ValueError, match="loss_batches"):
        prune_channels(net, pixels(), RATIO, 1, "taylor", no_fine_tuning)


@pytest.mark.parametrize("ratio, steps, importance", [(0.0, 1, "l2"), (1.0, 1, "l2"),
                                                      (0.5, 0, "l2"), (0.5, 1, "l1")])
def test_bad_arguments_are_value_errors(ratio, steps, importance):
    with pytest.raises(ValueError):
        prune_channels(SmallCNN(1, 3, [8, 16]), pixels(), ratio, steps, importance,
                       no_fine_tuning)


def test_kept_channels_are_rounded_to_the_nearest_multiple():
    net = with_statistics(TabularMLP(num_features=5, num_classes=2, hidden=[64, 40, 16]))
    aligned = prune_channels(net, features(), RATIO, 2, "l2", no_fine_tuning, multiple=16)
    # 64·0.6 = 38.4 → 32; 40·0.6 = 24 → 32; 16·0.6 = 9.6 → 16 would keep all: left at 9
    assert out_channels(aligned.net) == {"body.0": 32, "body.4": 32, "body.8": 9,
                                         "classifier": 2}
    exact = prune_channels(net, features(), RATIO, 2, "l2", no_fine_tuning, multiple=1)
    assert out_channels(exact.net) == {"body.0": 38, "body.4": 24, "body.8": 9, "classifier": 2}


# ----------------------------------------------------------------------------- the ONNX graph


def onnx_graph(net: nn.Module, x: torch.Tensor) -> onnx.ModelProto:
    from ttc.convert.tracing import export_graph, slim_graph

    spec = InputSpec(name="pixels", shape=("batch", *x.shape[1:]), dtype="float32")
    return slim_graph(export_graph(net, x.numpy(), 18, spec, ["logits", "probabilities"]))


def weight_shapes(model: onnx.ModelProto, op_types: tuple[str, ...]) -> list[list[int]]:
    initializers = {i.name: list(i.dims) for i in model.graph.initializer}
    return [initializers[node.input[1]] for node in model.graph.node
            if node.op_type in op_types and node.input[1] in initializers]


def test_the_exported_pruned_graph_is_dense_smaller_and_runs_as_torch():
    net = with_statistics(SmallCNN(in_channels=1, num_classes=3, widths=[8, 16]))
    pruned = prune_channels(net, pixels(), RATIO, 1, "l2", no_fine_tuning).net
    full, small = onnx_graph(net, pixels()), onnx_graph(pruned, pixels())
    onnx.checker.check_model(small, full_check=True)
    # the same nodes (no masks, no gathers of kept channels), with narrower weights
    assert sorted(n.op_type for n in small.graph.node) == sorted(n.op_type for n in
                                                                full.graph.node)
    assert weight_shapes(small, ("Conv",)) == [[4, 1, 3, 3], [4, 4, 3, 3], [9, 4, 3, 3],
                                               [9, 9, 3, 3]]
    assert weight_shapes(full, ("Conv",))[0] == [8, 1, 3, 3]
    assert sorted(weight_shapes(small, ("Gemm",))[0]) == [3, 9]

    def elements(model: onnx.ModelProto) -> int:
        return sum(int(np.prod(i.dims)) for i in model.graph.initializer)

    assert elements(small) < 0.5 * elements(full)
    session = ort.InferenceSession(small.SerializeToString(), providers=["CPUExecutionProvider"])
    x = pixels(7)
    logits, _ = session.run(None, {"pixels": x.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(logits, pruned(x).numpy(), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- the bundle's rebuild


@pytest.mark.parametrize("name, importance", [
    ("small_cnn", "taylor"), ("tabular_mlp", "l2"), ("tabular_resmlp", "taylor"),
    ("text_cnn", "taylor"), ("text_transformer", "l2"), ("resnet18", "l2"),
    ("mobilenet_v3_small", "l2")])
def test_a_fresh_network_resized_to_the_recorded_shapes_computes_the_same(name, importance):
    build, example = NETWORKS[name]
    net = with_statistics(build())
    assert prune_unsupported_reason(net, example()) is None
    x = example()
    batches = (lambda: iter([(x, labels_for(x, 2))])) if importance == "taylor" else None
    result = prune_channels(net, x, RATIO, 2, importance, no_fine_tuning, batches)
    pruned = result.net
    assert result.channels and all(after == kept_channels(before, RATIO, CHANNEL_MULTIPLE)
                                   for before, after in result.channels.values())
    kept = [m for m in pruned.modules() if isinstance(m, (nn.Embedding, nn.MultiheadAttention))]
    assert all(m.embedding_dim == 16 if isinstance(m, nn.Embedding) else m.embed_dim == 16
               for m in kept)  # embeddings and attention keep their widths
    record = json.loads(json.dumps(shapes_of(pruned)))  # what the manifest keeps
    state = {k: v.clone() for k, v in pruned.state_dict().items()}
    rebuilt = resized_to(build(), record)
    rebuilt.load_state_dict(state, strict=True)
    rebuilt.eval()
    with torch.no_grad():
        assert torch.equal(rebuilt(x), pruned(x))
    assert shapes_of(rebuilt) == record


def test_resized_to_refuses_shapes_it_cannot_apply():
    def fresh() -> nn.Module:
        return SmallCNN(3, 3, [8, 16])

    shapes = shapes_of(prune_channels(fresh(), pixels().repeat(1, 3, 1, 1), RATIO, 1, "l2",
                                      no_fine_tuning).net)
    refused = {  # a bundle's record is data: each of these is one clear ValueError
        "missing": {k: v for k, v in shapes.items() if k != "classifier.bias"},
        "unknown": {**shapes, "extra.weight": [1]},
        "not a pruned shape": {**shapes, "features.0.weight": [9, 3, 3, 3]},  # wider
        "not a pruned shape of the network's [3]": {**shapes, "classifier.bias": [3, 1]},
        "kernel": {**shapes, "features.0.weight": [4, 3, 1, 1]},
        "resizing gave": {**shapes, "classifier.weight": [2, 9]},  # its bias stays 3
        "(SmallCNN) holds mean": {**shapes, "mean": [1, 2, 1, 1]},  # a buffer of its own
        "BatchNorm tensors disagree": {**shapes, "features.1.running_var": [3]},
    }
    for phrase, record in refused.items():
        with pytest.raises(ValueError, match=re.escape(phrase)):
            resized_to(fresh(), record)
    with pytest.raises(ValueError, match="not an object"):
        resized_to(fresh(), [["features.0.weight", [4, 3, 3, 3]]])


# ----------------------------------------------------------------------------- where it applies


class NoGradNet(nn.Module):
    """Its features computed without autograd: the tracer sees no graph between the layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            features = torch.relu(self.conv(x)).mean(dim=(2, 3))
        return self.head(features)


class ScaledNet(nn.Module):
    """A bare nn.Parameter as wide as a hidden layer: no rebuild knows how to resize it."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(64, 16)
        self.scale = nn.Parameter(torch.ones(16))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(x.flatten(1))) * self.scale)


class ConvHeadNet(nn.Module):
    """Logits from a 1×1 convolution: no nn.Linear head for pruning to keep."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.out = nn.Conv2d(8, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.conv(x))).mean(dim=(2, 3))


class FixedWidthNet(nn.Module):
    """A forward that flattens to a width written in its code."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.head = nn.Linear(8 * 8 * 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).reshape(len(x), 8 * 8 * 8))


@pytest.mark.parametrize("net, phrase", [
    (NoGradNet(), "finds no channels to prune"),
    (ScaledNet(), "cannot be rebuilt from its shapes: the network (ScaledNet) holds scale"),
    (ConvHeadNet(), "changes its output's shape from [4, 3]"),
    (FixedWidthNet(), "its forward fails once channels are pruned"),
    (nn.Module.__new__(HFTextNet), "attention projections"),
])
def test_networks_that_cannot_be_pruned_say_why(net, phrase):
    reason = prune_unsupported_reason(net, pixels())
    assert reason is not None and phrase in reason and "\n" not in reason
