"""The test-time methods inference.py runs, in the order it runs them: on the test split each
asked method fills its report section (in this order, after `calibration`), and on --input (in
this process or on Ray workers) the one asked method predicts. Adding a method is its own module
with an entry of the `Method` shape, and one line in METHODS.

Light at import: each entry loads its method's heavy modules (onnx, PyTorch for Tent) only when
it runs, so that inference.py --help and plain --input runs stay fast.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ttc.testtime.iterative_method import Iterative
from ttc.testtime.tta_method import TTA
from ttc.testtime.ttt_method import TTT

if TYPE_CHECKING:
    from ttc.serving.batch import Predictor
    from ttc.serving.manifest import Manifest
    from ttc.testtime.served import Evaluation, Heldout, RunFlags, Served


class Method(Protocol):
    """One test-time method: the flag that asks for it (as --input's refusal to combine methods
    names it), the report section its evaluation fills, and its options, built from the flags
    (what the method's own code receives, never the whole Config)."""

    flag: str
    key: str

    def asked(self, flags: RunFlags) -> bool: ...

    def options(self, flags: RunFlags, manifest: Manifest) -> object: ...

    def evaluate(self, flags: RunFlags, served: Served, heldout: Heldout) -> Evaluation: ...

    def predictor(self, flags: RunFlags, served: Served) -> tuple[Predictor, list[str]]: ...


METHODS: tuple[Method, ...] = (
    TTA(),
    TTT(),
    Iterative(),
)


def asked_methods(flags: RunFlags) -> list[Method]:
    """The methods this run asked for, in METHODS' order."""
    return [method for method in METHODS if method.asked(flags)]
