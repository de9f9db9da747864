"""What every test-time method builds on: the chosen graph of a bundle as inference.py opened it,
the held-out data it is evaluated on, what an evaluation hands back, the flags the methods read,
and the plain predictor (no method, or the state loop).

Light on purpose (numpy, no onnx): inference.py imports the registry, and so this module, before
any flag is checked, and its --help stays fast.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from ttc.serving.runtime import batches_of, session_runner
from ttc.tasks.registry import task_of_kind

if TYPE_CHECKING:
    import onnxruntime as ort

    from ttc.serving.batch import Predictor
    from ttc.serving.bundle import BundlePaths
    from ttc.serving.manifest import Manifest
    from ttc.serving.runtime import RuntimeOptions
    from ttc.testtime.tta import TTAOptions
    from ttc.testtime.ttt import TTTSettings

Variants = Callable[[np.ndarray], dict]  # inputs → {variant name: probabilities}


class RunFlags(Protocol):
    """The flags the test-time methods read, as the inference and serving stages hold them
    (ttc/options/stages.py's InferenceOptions and ServeOptions): the methods name what they
    need here, and take either."""

    tta: bool
    ttt: bool
    ttt_method: str
    iterative: str
    iterative_backend: str
    iterations: int
    iterative_tol: float | None
    iterative_patience: int
    ensemble: str | None
    batch_size: int
    seed: int

    def tta_options(self) -> TTAOptions: ...

    def ttt_settings(self, kind: str) -> TTTSettings: ...

    def ensemble_members(self) -> list[str]: ...


@dataclass
class Served:
    """The chosen graph (fp32, int8 or fp16) of a bundle and its session, which the methods run
    or build their own graphs around, with the session settings they open theirs with.
    `adapts_model_graph(method)`: whether test-time training adapts model.onnx itself (a network
    without BatchNorm) rather than model.bn.onnx, raising where --ttt_method cannot apply; which
    archs lack BatchNorm is the flags' knowledge (ttc/options/ttt.py), which this layer
    does not import."""

    paths: BundlePaths
    manifest: Manifest
    session: ort.InferenceSession
    model_path: Path
    runtime: RuntimeOptions
    adapts_model_graph: Callable[[str], bool]

    @property
    def classes(self) -> int:
        return self.manifest.classes

    @property
    def kind(self) -> str:
        return self.manifest.preprocessing.kind

    @property
    def pad_id(self) -> int:
        return self.manifest.input.pad_id


@dataclass
class Heldout:
    """The held-out data a method is evaluated on: the test split, the validation split (TTA's
    adaptive threshold; None unless --tta) and the test split's single pass without the
    bundle's temperature (None: the graph has no logits output)."""

    test: tuple[np.ndarray, np.ndarray]
    val: tuple[np.ndarray, np.ndarray] | None
    raw: np.ndarray | None
    # the calibration slice (data.CALIBRATION): rows no selection step saw; None where not
    # loaded, empty with --calibration_fraction 0
    calibration: tuple[np.ndarray, np.ndarray] | None = None


@dataclass
class Evaluation:
    """A method's report section, and its calibration variants as a function of the inputs
    (what --eval_shift measures on corrupted copies; None for a method without any)."""

    section: dict
    variants: Variants | None = None


def plain_predictor(served: Served, batch_size: int, state_passes: int = 1
                    ) -> tuple[Predictor, list[str]]:
    """The chosen graph alone (fed its state `state_passes` times for --iterative state): text
    rows batched by length, others in their order; no extra columns."""
    run = session_runner(served.session, state_passes=state_passes)
    if task_of_kind(served.kind).input_role == "text":  # token ids of varying length
        return by_length(run, batch_size, served.pad_id), []
    return (lambda x: (np.concatenate([run(b) for b in batches_of(x, batch_size)]), {})), []


def by_length(run: Callable[[np.ndarray], np.ndarray], size: int, pad_id: int) -> Predictor:
    """Token ids → probabilities in the rows' order, the rows batched by length: a batch is
    padded to its longest text, so texts of like length waste the least compute (3.2-3.5x the
    throughput for a transformer on SMS texts, benchmarks.md). Each row is predicted on its own
    here (no test-time method adapts to the batch on this path), so the order changes the speed
    only, up to float rounding; dynamic int8 quantizes activations by each batch's range, so
    there a row's probabilities move by about 1e-3 with its batch, in any order."""

    def predict(x: np.ndarray) -> tuple[np.ndarray, dict]:
        order = np.argsort((x != pad_id).sum(axis=1), kind="stable")
        probabilities = np.concatenate([run(b) for b in batches_of(x[order], size, pad_id)])
        restored = np.empty_like(probabilities)
        restored[order] = probabilities
        return restored, {}

    return predict
