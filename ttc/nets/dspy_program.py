"""The DSPy program whose model is a torch network: ClassifierProgram (an image, a text or a
feature row in, label and confidence out), the examples and metric dspy.Evaluate scores it with,
and a network's logits and accuracy on a split. Importing this module imports torch and dspy.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import dspy
import numpy as np
import torch
from torch import nn

from ttc.inputs.data import Split
from ttc.inputs.preprocess import PAD_ID, HFTokenizer, Tokenizer, trim_padding
from ttc.nets.device import to_device
from ttc.reporting.metrics import accuracy


class ClassifierProgram(dspy.Module):
    """A DSPy program whose 'model' is a torch network: an image, a text or a feature row in,
    label and confidence out. Text programs tokenize inside, so the program is text -> label."""

    def __init__(self, net: nn.Module, labels: Sequence[str], input_field: str,
                 tokenizer: Tokenizer | HFTokenizer | None = None, pad_id: int = PAD_ID) -> None:
        super().__init__()
        self.net = net
        self.labels = list(labels)
        self.input_field = input_field
        self.tokenizer = tokenizer
        self.pad_id = pad_id
        self._batched: dict[int, np.ndarray] | None = None  # id(input) → probabilities

    def encode(self, values: Sequence) -> np.ndarray:
        """Program inputs → the network's input array."""
        if self.tokenizer is not None:
            return self.tokenizer.encode_batch(values)
        return np.stack(values)

    def forward(self, **inputs) -> dspy.Prediction:
        value = inputs[self.input_field]
        probabilities = self._batched.get(id(value)) if self._batched is not None else None
        if probabilities is None:
            probabilities = self.predict_proba(self.encode([value]))[0]
        best = int(probabilities.argmax())
        return dspy.Prediction(label=self.labels[best], confidence=float(probabilities[best]),
                               probabilities=probabilities)

    @contextlib.contextmanager
    def batched_for(self, examples: Sequence[dspy.Example]):
        """Within the block, forward() on one of these examples' inputs (the same object, as
        dspy.Evaluate passes it) returns probabilities computed here for them in batches:
        Evaluate calls the program one example at a time, and the network run on one input
        costs nearly as much as on 256 (builtin:digits, 269 validation images, 6 epochs: the
        training stage 4.6 → 4.0 s, the same accuracy at every epoch). The first example
        still runs alone, as a server's single request does: a network that fails on a batch
        of one fails in training, not in serving."""
        values = [example[self.input_field] for example in examples][1:]
        probabilities = self.predict_proba(self.encode(values)) if values else []
        self._batched = {id(v): p for v, p in zip(values, probabilities)}
        try:
            yield self
        finally:
            self._batched = None

    def predict_proba(self, pixels: np.ndarray, batch_size: int = 256) -> np.ndarray:
        return torch.softmax(torch.from_numpy(self.predict_logits(pixels, batch_size)), -1).numpy()

    def predict_logits(self, pixels: np.ndarray, batch_size: int = 256) -> np.ndarray:
        self.net.eval()
        device = next(self.net.parameters()).device
        with torch.no_grad():
            chunks = [self.net(network_batch(pixels[i:i + batch_size], self.pad_id,
                                             device)).float().cpu()
                      for i in range(0, len(pixels), batch_size)]
        return torch.cat(chunks).numpy()


def network_batch(x: np.ndarray | torch.Tensor, pad_id: int, device: torch.device | str = "cpu"
                  ) -> torch.Tensor:
    """A batch as the network takes it: token ids without the padding columns no text in the
    batch needs (texts are padded to the longest of a whole split, and a transformer's cost
    grows with the length), on `device`."""
    if x.ndim == 2 and x.dtype in (np.int64, torch.int64) and len(x):
        x = trim_padding(np.asarray(x), pad_id)
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    return to_device(x, device)


def to_examples(split: Split, labels: Sequence[str], field: str) -> list[dspy.Example]:
    values = split.raw if split.raw is not None else split.x
    return [dspy.Example(**{field: v, "label": labels[y]}).with_inputs(field)
            for v, y in zip(values, split.y)]


def label_match(example: dspy.Example, prediction: dspy.Prediction, trace=None) -> bool:
    return example.label == prediction.label



def split_logits(net: nn.Module, x: np.ndarray) -> np.ndarray:
    """The network's logits on a split's inputs, in eval mode."""
    return ClassifierProgram(net, [], "", pad_id=getattr(net, "pad_id", PAD_ID)).predict_logits(x)


def split_accuracy(net: nn.Module, split: Split) -> float | None:
    if len(split) == 0:
        return None
    program = ClassifierProgram(net, [], "", pad_id=getattr(net, "pad_id", PAD_ID))
    return accuracy(program.predict_proba(split.x), split.y)
