"""Test-time augmentation as inference.py runs it (`--tta true`): the registry's entry. The
transforms, merges and runner are tta.py's; this module only wires them to a served graph.
Light at import (tta.py, which imports onnx, loads when the method runs)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ttc.testtime.served import Evaluation, Heldout, RunFlags, Served
from utils import LOG

if TYPE_CHECKING:
    import numpy as np

    from ttc.serving.batch import Predictor
    from ttc.serving.manifest import Manifest
    from ttc.testtime.tta import TTAOptions, TTARunner


@dataclass(frozen=True)
class TTA:
    flag: ClassVar[str] = "--tta"
    key: ClassVar[str] = "tta"

    def asked(self, flags: RunFlags) -> bool:
        return flags.tta

    def options(self, flags: RunFlags, manifest: Manifest) -> TTAOptions:
        return flags.tta_options()

    def evaluate(self, flags: RunFlags, served: Served, heldout: Heldout) -> Evaluation:
        """TTA against the plain pass on the test split, judged on the validation split."""
        from ttc.testtime.tta import evaluate_tta

        options = self.options(flags, served.manifest)
        tta = evaluate_tta(runner(served, options, heldout.test[0]), heldout.test, heldout.val,
                           options.threshold)
        (LOG.warning if tta.lowers else LOG.info)("%s", tta.verdict)
        return Evaluation(tta.report_section())

    def predictor(self, flags: RunFlags, served: Served) -> tuple[Predictor, list[str]]:
        tta = runner(served, self.options(flags, served.manifest))
        return (lambda x: (tta(x), {})), []


def runner(served: Served, options: TTAOptions, rows: np.ndarray | None = None) -> TTARunner:
    """The runner on the served graph, its plan (--tta_plan auto) timed on a batch of `rows`
    (the test split's; None, as for --input and serve.py: rows made up from the manifest)."""
    from ttc.testtime.tta import tta_runner

    return tta_runner(served.session, served.model_path, served.manifest, options,
                      served.runtime, rows)
