"""The segmenter's training stage (ttc/tasks/segment/training.py) on two dozen 16-pixel digit
canvases: its history, the kept network's validation mean IoU recomputed from the network
alone, a falling loss, void pixels that neither the loss nor the scores see, the candidate
search keeping the higher mean IoU, and a diverging learning rate."""
from __future__ import annotations

import logging
import math

import dspy
import numpy as np
import pytest
import torch

from config import Config
from ttc.inputs.data import DataOptions
from ttc.nets.finite import TrainingDiverged
from ttc.nets.shards import Shard
from ttc.tasks.segment.canvases import write_digit_canvases
from ttc.tasks.segment.data import load_segmentation_dataset
from ttc.tasks.segment.metrics import PixelConfusion, summary_scores
from ttc.tasks.segment.training import (PixelAccuracy, SegmentationTrainer, SegmenterProgram,
                                        build_segmenter, pooled_miou, segmentation_architecture,
                                        to_examples, train_segmenter)

VOID = 255


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny convolutions: torch's thread pool only contends with the other xdist worker (two
    threads beside another torch process made these tests 8 times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = write_digit_canvases(tmp_path_factory.mktemp("canvases"), 24, size=16, seed=0)
    return load_segmentation_dataset(DataOptions(path=str(root), model_type="image_segmenter",
                                                 show_progress=False))


def config(**changes) -> Config:
    settings = {"model_type": "image_segmenter", "epochs": 2, "batch_size": 8, "seed": 0,
                "learning_rate": 1e-2, "no_progress": True, **changes}
    return Config(**settings)


def miou_of(net: torch.nn.Module, x: np.ndarray, y: np.ndarray, classes: int) -> float:
    """The network's mean IoU on (x, y), computed here from its logits."""
    with torch.no_grad():
        masks = net.eval()(torch.from_numpy(x)).argmax(1).numpy()
    return summary_scores(PixelConfusion(classes, VOID).add(masks, y).matrix)["mean_iou"]


def test_two_epochs_keep_the_best_epoch_and_its_validation_miou(dataset):
    trained = train_segmenter(config(), dataset)
    assert [r.epoch for r in trained.history] == [1, 2] and trained.epochs_planned == 2
    best = max(trained.history, key=lambda r: (r.val_accuracy, r.epoch))
    assert trained.best_epoch == best.epoch and trained.val_accuracy == best.val_accuracy
    classes = len(dataset.labels)
    assert trained.val_accuracy == pytest.approx(
        miou_of(trained.net, dataset.val.x, dataset.val.y, classes), abs=1e-6)
    assert trained.train_accuracy == pytest.approx(
        miou_of(trained.net, dataset.train.x, dataset.train.y, classes), abs=1e-6)
    assert not trained.net.training and next(trained.net.parameters()).device.type == "cpu"
    # The loss starts near ln(classes) and falls; the validation loss is a pixel mean.
    assert trained.initial_loss == pytest.approx(math.log(classes), rel=0.5)
    assert all(math.isfinite(r.loss) and math.isfinite(r.val_loss) for r in trained.history)
    assert trained.history[-1].loss < trained.history[0].loss < trained.initial_loss
    assert all(0 <= r.train_accuracy <= 1 and 0 <= r.val_accuracy <= 1
               for r in trained.history)
    record = trained.architecture
    assert record["name"] == "UNet" and record["dropout"] == 0.1
    assert record["num_parameters"] == sum(p.numel() for p in trained.net.parameters())
    assert trained.labels == dataset.labels and trained.samples == len(dataset.train)
    assert trained.learning_rate == 1e-2 and trained.seed == 0
    assert len(trained.candidates) == 1 and trained.candidates[0].val_accuracy == (
        trained.val_accuracy)
    section = trained.report_section()
    assert section["network"] == "UNet" and section["epochs_run"] == 2


def test_dropout_flag_goes_into_the_record_of_a_network_that_takes_it(dataset):
    assert segmentation_architecture(config(dropout=0.3), dataset)["dropout"] == 0.3
    record = segmentation_architecture(config(arch="lraspp_mobilenet_v3_large"), dataset)
    assert "dropout" not in record


def test_a_trailing_batch_of_one_image_is_dropped():
    trainer = SegmentationTrainer(epochs=1, batch_size=8, learning_rate=1e-3,
                                  weight_decay=0.0, seed=0)
    sizes = [len(b) for b in trainer._batches(Shard(17), torch.Generator().manual_seed(0))]
    assert sizes == [8, 8]
    assert [len(b) for b in trainer._batches(Shard(1), torch.Generator())] == [1]


class VoidScrambler(torch.nn.Module):
    """A network whose logits on the void columns are pushed far off by a fixed pattern."""

    def __init__(self, net: torch.nn.Module, columns: int, classes: int, height: int) -> None:
        super().__init__()
        self.net, self.columns = net, columns
        noise = torch.from_numpy(np.random.default_rng(0).normal(
            0, 50, (1, classes, height, columns)).astype(np.float32))
        self.register_buffer("noise", noise)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        logits = self.net(pixels)
        return torch.cat([logits[..., :self.columns] + self.noise,
                          logits[..., self.columns:]], dim=-1)


def void_program(dataset, columns: int, scrambled: bool) -> SegmenterProgram:
    torch.manual_seed(0)
    architecture = segmentation_architecture(config(), dataset)
    net = build_segmenter(architecture, dataset.preprocessing)
    if scrambled:
        net = VoidScrambler(net, columns, len(dataset.labels),
                            dataset.preprocessing["image_size"][0])
    return SegmenterProgram(net, dataset.labels, VOID)


def voided(split, columns: int, keep_rows: int = 16) -> list[dspy.Example]:
    """The split's examples with the first `columns` columns void, and the rows from
    `keep_rows` on void too."""
    examples = to_examples(split)
    for example in examples:
        mask = example.mask.copy()
        mask[:, :columns] = VOID
        mask[keep_rows:] = VOID
        example["mask"] = mask
    return examples


@pytest.mark.parametrize("keep_rows", [16, 2])
def test_void_pixels_neither_train_nor_score(dataset, keep_rows):
    """Training with wild logits on the void pixels is training without them: the same
    losses, pixel accuracies, validation mean IoU and loss, epoch by epoch; with all but two
    rows of every mask void it still trains on those rows."""
    columns = 6
    trainset, valset = voided(dataset.train, columns, keep_rows), voided(dataset.val, columns)
    runs = []
    for scrambled in (False, True):
        trainer = SegmentationTrainer(epochs=2, batch_size=8, learning_rate=1e-2,
                                      weight_decay=1e-4, seed=0, patience=0,
                                      ignore_index=VOID, show_progress=False)
        trainer.compile(void_program(dataset, columns, scrambled), trainset=trainset,
                        valset=valset)
        runs.append(trainer)
    plain, scrambled = runs
    assert scrambled.initial_loss == pytest.approx(plain.initial_loss, rel=1e-5)
    for a, b in zip(plain.history, scrambled.history):
        assert b.loss == pytest.approx(a.loss, rel=1e-4)
        assert b.train_accuracy == pytest.approx(a.train_accuracy, abs=1e-6)
        assert b.val_accuracy == pytest.approx(a.val_accuracy, abs=1e-6)
        assert b.val_loss == pytest.approx(a.val_loss, rel=1e-4)
        assert math.isfinite(a.loss) and a.val_loss is not None
    assert plain.history[-1].loss < plain.initial_loss


def test_batched_scoring_gives_the_per_example_masks_and_the_pixel_loss(dataset):
    program = void_program(dataset, 0, scrambled=False)
    examples = to_examples(dataset.val)
    examples[0]["mask"] = np.full_like(examples[0].mask, VOID)  # counted nowhere
    evaluate = dspy.Evaluate(devset=examples, metric=PixelAccuracy(VOID), num_threads=1,
                             display_progress=False, max_errors=1)
    alone = evaluate(program)
    with program.batched_for(examples) as scored:
        batched = evaluate(program)
    for (_, a, _), (_, b, _) in zip(alone.results, batched.results):
        assert np.array_equal(a.mask, b.mask) and a.classes == b.classes
    classes = len(dataset.labels)
    assert pooled_miou(batched.results, classes, VOID) == pytest.approx(
        miou_of(program.net, dataset.val.x[1:], dataset.val.y[1:], classes), abs=1e-9)
    with torch.no_grad():
        logits = program.net(torch.from_numpy(dataset.val.x[1:]))
    expected = torch.nn.functional.cross_entropy(logits, torch.from_numpy(dataset.val.y[1:]))
    assert scored.loss == pytest.approx(float(expected), rel=1e-5)
    assert scored.pixels == dataset.val.y[1:].size


def test_the_search_keeps_the_learning_rate_with_the_higher_validation_miou(dataset):
    trained = train_segmenter(config(lr_candidates="1e-5,3e-2", learning_rate=None), dataset)
    rates = [c.learning_rate for c in trained.candidates]
    assert rates == [1e-5, 3e-2]
    scores = [c.val_accuracy for c in trained.candidates]
    assert scores[0] != scores[1]
    best = trained.candidates[int(np.argmax(scores))]
    assert trained.chosen_candidate == best.index and trained.learning_rate == best.learning_rate
    assert trained.val_accuracy == best.val_accuracy == pytest.approx(
        miou_of(trained.net, dataset.val.x, dataset.val.y, len(dataset.labels)), abs=1e-6)
    assert trained.report_section()["candidates"][best.index]["val_accuracy"] == max(scores)


def test_a_diverging_learning_rate_fails_alone_and_is_skipped_beside_another(dataset, caplog):
    with pytest.raises(TrainingDiverged) as failed:
        train_segmenter(config(learning_rate=1e12), dataset)
    assert "training diverged" in str(failed.value) and failed.value.learning_rate == 1e12
    with caplog.at_level(logging.WARNING, logger="ttc"):
        trained = train_segmenter(config(lr_candidates="1e12,1e-2", learning_rate=None),
                                  dataset)
    assert trained.learning_rate == 1e-2 and len(trained.diverged_candidates) == 1
    assert "skipped, the search goes on" in caplog.text
