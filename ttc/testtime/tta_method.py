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
    from ttc.testtime.tta_policy import Policy


@dataclass(frozen=True)
class TTA:
    flag: ClassVar[str] = "--tta"
    key: ClassVar[str] = "tta"

    def asked(self, flags: RunFlags) -> bool:
        return flags.tta

    def options(self, flags: RunFlags, manifest: Manifest) -> TTAOptions:
        return flags.tta_options()

    def evaluate(self, flags: RunFlags, served: Served, heldout: Heldout) -> Evaluation:
        """TTA against the plain pass on the test split, judged on the validation split; with
        --tta_transforms auto the views chosen on the calibration slice first."""
        from ttc.testtime.tta import evaluate_tta

        options = self.options(flags, served.manifest)
        policy = chosen_policy(served, options, heldout.calibration)
        tta = evaluate_tta(runner(served, options, heldout.test[0], policy), heldout.test,
                           heldout.val, options.threshold)
        section = tta.report_section()
        if policy is not None:
            tta.verdict = section["verdict"] = f"{policy.summary()}; {tta.verdict}"
            section.update(policy=policy.report(), candidates=policy.candidates)
        (LOG.warning if tta.lowers else LOG.info)("%s", tta.verdict)
        return Evaluation(section)

    def predictor(self, flags: RunFlags, served: Served) -> tuple[Predictor, list[str]]:
        """--input, serve.py and the Predictor API: with auto, the views chosen on the bundle's
        calibration slice, reloaded from its data as inference.py reloads it (the same rows, the
        same search: the same views)."""
        options = self.options(flags, served.manifest)
        policy = chosen_policy(served, options, reloaded_slice(flags, served))
        tta = runner(served, options, policy=policy)
        return (lambda x: (tta(x), {})), []


def chosen_policy(served: Served, options: TTAOptions,
                  rows: tuple[np.ndarray, np.ndarray] | None) -> Policy | None:
    """--tta_transforms auto[:LIST]: the policy searched on `rows` (logged); None otherwise."""
    from ttc.testtime.transforms import is_auto

    if not is_auto(options.transforms):
        return None
    from ttc.serving.runtime import session_runner
    from ttc.testtime.tta_policy import choose_policy

    policy = choose_policy(session_runner(served.session), options.transforms,
                           served.manifest.preprocessing.spec, options.merge, options.seed,
                           rows, options.batch_size, served.pad_id)
    LOG.info("%s", policy.summary())
    return policy


def reloaded_slice(flags: RunFlags, served: Served) -> tuple[np.ndarray, np.ndarray] | None:
    """The bundle's calibration slice, from --dataset_path or the data its manifest records;
    None when TTA's views are not auto (nothing is read)."""
    from ttc.testtime.transforms import is_auto

    if not is_auto(flags.tta_options().transforms):
        return None
    from ttc.inputs.data import CALIBRATION, load_bundle_dataset, split_paths_of

    data = load_bundle_dataset(served.manifest, getattr(flags, "dataset_path", None),
                               (CALIBRATION,), False, split_paths_of(flags),
                               "; --tta_transforms auto chooses its views on the bundle's "
                               "calibration slice, or name the views")
    return data.calibration.x, data.calibration.y


def runner(served: Served, options: TTAOptions, rows: np.ndarray | None = None,
           policy: Policy | None = None) -> TTARunner:
    """The runner on the served graph, its plan (--tta_plan auto) timed on a batch of `rows`
    (the test split's; None, as for --input and serve.py: rows made up from the manifest);
    `policy`: the views and merge auto chose."""
    from ttc.testtime.tta import tta_runner

    chosen = (policy.transforms, policy.merge) if policy is not None else None
    return tta_runner(served.session, served.model_path, served.manifest, options,
                      served.runtime, rows, chosen)
