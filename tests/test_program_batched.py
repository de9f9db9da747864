"""ClassifierProgram.batched_for: dspy.Evaluate scores the program one example at a time, and
training scores it on the validation split every epoch; inside the block the network runs once
over all the examples in batches, and each per-example call reads its row. The scores,
labels and probabilities are the ones the per-example calls give (texts of many lengths, padded
to the batch's longest: the network ignores padding), and an input outside the block's examples
still runs the network."""
from __future__ import annotations

import dspy
import numpy as np
import pytest
import torch

from conftest import topic_texts


def evaluate(program, examples):
    from ttc.nets.dspy_program import label_match

    with np.errstate(all="ignore"):
        return dspy.Evaluate(devset=examples, metric=label_match, num_threads=1,
                             display_progress=False, max_errors=1)(program)


@pytest.mark.parametrize("kind", ["text", "image"])
def test_batched_evaluation_gives_the_per_example_results(kind):
    from ttc.inputs.preprocess import Tokenizer
    from ttc.nets.models import SmallCNN, TextClassifier
    from ttc.nets.dspy_program import ClassifierProgram

    torch.manual_seed(0)
    labels = ["food", "sports", "weather"]
    if kind == "text":
        texts = [t for t, _ in topic_texts(per_class=40)]
        tokenizer = Tokenizer.fit(texts, max_vocab=200, max_length=16)
        net = TextClassifier(tokenizer.vocab_size, len(labels))
        values, field = texts, "text"
    else:
        tokenizer = None
        net = SmallCNN(in_channels=1, num_classes=len(labels), widths=[8, 16])
        values = list(np.random.default_rng(0).random((120, 1, 8, 8), dtype=np.float32))
        field = "image"
    net.eval()
    examples = [dspy.Example(**{field: v, "label": labels[k % 3]}).with_inputs(field)
                for k, v in enumerate(values)]
    program = ClassifierProgram(net, labels, field, tokenizer)
    one_by_one = evaluate(program, examples)
    calls = []
    net.register_forward_hook(lambda *_: calls.append(1))
    with program.batched_for(examples):
        before = len(calls)  # the block's own batches (119 examples: one)
        batched = evaluate(program, examples)
        assert before == 1 and len(calls) == 2  # the first example alone, no other run
        outside = program(**{field: values[0].copy() if kind == "image" else values[0] + " !"})
    assert program._batched is None  # gone after the block
    assert batched.score == one_by_one.score
    for (_, alone, _), (_, together, _) in zip(one_by_one.results, batched.results):
        assert together.label == alone.label
        np.testing.assert_allclose(together.probabilities, alone.probabilities, atol=1e-6)
    if kind == "image":  # an equal array that is another object runs the network too
        np.testing.assert_allclose(outside.probabilities, one_by_one.results[0][1].probabilities,
                                   atol=1e-6)
    assert outside.label in labels
