"""A segmenter served (its `Parts.served` part; ttc/online/served.py says the shape): an image
in (a row's base64 file bytes, as an image classifier's rows), its mask out, with each class's
pixel count and share: the values `inference.py --input` writes for that image, by the same code
(predict.predicted_batch decodes each image as the model was trained and reads its own size;
predict.Predicting checks the graph's masks; predict.resized_mask takes a mask back to the
image's size; masks.mask_image is the mask file's PNG). `ImageServing` is what a detector's part
(ttc/tasks/detect/served.py) shares with it: the rows to images, the batch's split back into
its requests, the test-time flags refused, the warm-up. numpy and Pillow only: no torch."""
from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from ttc.serving.records import RowError
from ttc.tasks.segment.evaluate import mask_runner
from ttc.tasks.segment.masks import class_shares, mask_image
from ttc.tasks.segment.predict import Listed, Predicting, predicted_batch, resized_mask
from utils import ConfigError

if TYPE_CHECKING:
    from ttc.testtime.served import RunFlags

IMAGE_KEY = "image"  # a row's key for its image (records.IMAGE_KEY: an image classifier's too)
SHARE_DECIMALS = 6  # as the summary table's shares (predict.SummaryWriter)
LISTED_CLASSES = 20  # classes a tool's description names


class ImageServing:
    """What serving an image model whose answers are its own (a segmenter's masks, a detector's
    boxes) takes: `batch` (listed images → each one's result or error, in order) and `answer`
    (a result → its JSON) in a subclass, and `runner`, the session's batch run."""

    extra: list[str] = []
    task_words = "an image model"

    def __init__(self, opened: Any) -> None:
        self.manifest, self.reader = opened.manifest, opened.reader
        self.preprocessing = opened.manifest.preprocessing.spec
        self.labels = list(opened.manifest.labels)
        refuse_test_time(opened.options, opened.manifest.model_type)
        self.run = self.runner(opened.session)

    @staticmethod
    def runner(session: Any) -> Any:
        raise NotImplementedError

    def batch(self, items: Sequence[Listed]) -> list:
        raise NotImplementedError

    def answer(self, result: Any) -> dict:
        raise NotImplementedError

    # ------------------------------------------------------------------ predicting

    def predict_parts(self, parts: Sequence[tuple[Sequence[Mapping], int]]) -> list:
        """Every part's images in one batch (one model run); per part an object array of its
        rows' answers, or the RowError of its first row that could not be predicted."""
        items = [self.request_item(row, number) for rows, first in parts
                 for number, row in enumerate(rows, first)]
        results = self.batch(items)
        outcomes, start = [], 0
        for rows, first in parts:
            outcomes.append(self.part_outcome(results[start:start + len(rows)], first))
            start += len(rows)
        return outcomes

    def request_item(self, row: Mapping, number: int) -> Listed:
        """A row as predict.predicted_batch's item: its image's bytes in memory (base64 by the
        image classifiers' rules, records.RecordReader), or the reason it has none."""
        if IMAGE_KEY not in row:
            return Listed(str(number), io.BytesIO(), None,
                          f"the row lacks the key {IMAGE_KEY!r} (send {{\"{IMAGE_KEY}\": "
                          "\"<the image file's bytes, base64>\"}})")
        cell = row[IMAGE_KEY]
        if not isinstance(cell, str):
            cell = float("nan") if cell is None else str(cell)
        decoded, errors = self.reader._images([cell])  # noqa: SLF001 - the one base64 rule
        return Listed(str(number), io.BytesIO(next(iter(decoded.values()))[0]), None, errors[0])

    def part_outcome(self, results: Sequence, first: int) -> tuple[np.ndarray, dict] | RowError:
        failed = [(number, result.error) for number, result in enumerate(results, first)
                  if result.error]
        if failed:
            number, reason = failed[0]
            more = f" (and {len(failed) - 1} more rows)" if len(failed) > 1 else ""
            return RowError(f"row {number}: {reason}{more}", "fix the row; the others were fine")
        answers = np.empty(len(results), dtype=object)
        answers[:] = [self.answer(result) for result in results]
        return answers, {}

    def answers(self, outputs: np.ndarray, extra: Mapping[str, np.ndarray]) -> list[dict]:
        return list(outputs)

    def warm_up(self) -> None:
        """A blank image of the training size predicted and answered as a request is."""
        outcome = self.predict_parts([([{IMAGE_KEY: blank_png(self.preprocessing)}], 1)])[0]
        if isinstance(outcome, Exception):
            raise outcome
        self.answers(*outcome)

    def class_list(self) -> str:
        shown = ", ".join(repr(label) for label in self.labels[:LISTED_CLASSES])
        more = len(self.labels) - LISTED_CLASSES
        return shown + (f" and {more} more" if more > 0 else "")


def refuse_test_time(options: RunFlags, model_type: str) -> None:
    """An image model served is its graph as `inference.py --input` runs it: --tta, --ttt and
    --iterative do not apply to its new images (exit 2, before the port opens)."""
    asked = [flag for flag, on in (("--tta", options.tta), ("--ttt", options.ttt),
                                   ("--iterative", options.iterative != "none")) if on]
    if asked:
        raise ConfigError(f"serve.py runs an {model_type}'s graph as inference.py --input does: "
                          f"{' and '.join(asked)} do not apply to its new images yet",
                          f"drop {'/'.join(asked)}")


def blank_png(preprocessing: Mapping) -> str:
    """A black image of the training size and channels, as a row's base64 PNG."""
    from PIL import Image

    height, width = map(int, preprocessing["image_size"])
    mode = "L" if int(preprocessing["channels"]) == 1 else "RGB"
    buffer = io.BytesIO()
    Image.new(mode, (width, height)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@dataclass
class ServedMask:
    """One image's mask at its own size, or the reason it could not be predicted."""

    mask: np.ndarray | None = None
    error: str = ""


def mask_png(mask: np.ndarray) -> bytes:
    """The mask file inference.py writes (masks.write_mask), as bytes."""
    buffer = io.BytesIO()
    mask_image(mask).save(buffer, format="PNG")
    return buffer.getvalue()


class SegmenterServing(ImageServing):
    """A segmenter's answer per image: {"height", "width", "mask" (the mask PNG inference.py
    writes, base64), "pixels" (each class's pixel count), "shares" (each class's share, as the
    summary table's)}; V2: `mask` (BYTES, [rows]) and `pixels` (INT64, [rows, classes])."""

    task_words = "a segmenter"
    runner = staticmethod(mask_runner)

    def batch(self, items: Sequence[Listed]) -> list[ServedMask]:
        checks = Predicting(None, self.preprocessing, len(self.labels), self.run)

        def predicted(x: np.ndarray, _: list, sizes: list[tuple[int, int]]) -> list[ServedMask]:
            masks = checks._masks(x)  # noqa: SLF001 - --input's checks of the graph's masks
            return [ServedMask(resized_mask(mask, size)) for mask, size in zip(masks, sizes)]

        return predicted_batch(items, self.preprocessing,
                               lambda item, error: ServedMask(error=error), predicted)

    def answer(self, result: ServedMask) -> dict:
        mask, classes = result.mask, len(self.labels)
        counts = np.bincount(mask.ravel().astype(np.int64), minlength=classes)[:classes]
        shares = class_shares(mask, classes)
        return {"height": int(mask.shape[0]), "width": int(mask.shape[1]),
                "mask": base64.b64encode(mask_png(mask)).decode("ascii"),
                "pixels": {label: int(n) for label, n in zip(self.labels, counts)},
                "shares": {label: round(float(s), SHARE_DECIMALS)
                           for label, s in zip(self.labels, shares)}}

    def output_metadata(self) -> list[dict]:
        return [{"name": "mask", "datatype": "BYTES", "shape": [-1]},
                {"name": "pixels", "datatype": "INT64", "shape": [-1, len(self.labels)]}]

    def v2_outputs(self, outputs: np.ndarray, extra: Mapping[str, np.ndarray]) -> list[dict]:
        rows = len(outputs)
        return [{"name": "mask", "datatype": "BYTES", "shape": [rows],
                 "data": [answer["mask"] for answer in outputs]},
                {"name": "pixels", "datatype": "INT64", "shape": [rows, len(self.labels)],
                 "data": [answer["pixels"][label] for answer in outputs
                          for label in self.labels]}]

    def tool_description(self) -> str:
        arch = self.manifest.architecture.arch or self.manifest.architecture.name
        return (f"Segments an image: labels each of its pixels with one of {len(self.labels)} "
                f"classes ({self.class_list()}) with a trained {arch} network run by ONNX "
                "Runtime. Takes the image file's bytes, base64. Returns the image's height and "
                "width, its mask (a PNG whose pixel values are the class indices, base64) and "
                "each class's pixel count and share of the pixels.")
