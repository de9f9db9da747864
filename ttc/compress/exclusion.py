"""Which nodes int8 keeps in fp32 and which op types it quantizes: a `Quantizer` quantizes one
prepared graph with different nodes excluded, diagnoses each result layer by layer and judges it
on the validation split against fp32; --quantize_exclude auto searches the nodes to exclude one
step at a time (`search_exclusions`), --quantize_ops auto chooses between op sets
(`choose_op_set`). ttc/compress/quantization.py runs the trials; no torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import onnx

from ttc.compress.int8 import (op_set_candidates, quantize_prepared, quantizer_step,
                                require_known_nodes)
from ttc.compress.judging import MIN_SPEEDUP, Split, interleaved_p50_ms
from ttc.compress.quantizing import KeptFloat, ProbabilityScorer, Scorer
from ttc.convert.diagnosis import LayerError, diagnose
from ttc.serving.runtime import RuntimeOptions, create_session
from utils import LOG, first_line

DIAGNOSIS_BATCHES = 4  # of 32 calibration samples: enough to rank the layers, and quick
MAX_EXCLUSION_STEPS = 8  # --quantize_exclude auto: quantizations tried after the first


@dataclass(frozen=True)
class TrialOptions:
    """What the trials read of the flags: --calibration_method, the judge's --batch_size,
    --max_accuracy_drop and the CPU sessions it times on (RuntimeFlags.cpu_runtime), and
    --quantize_ops and --quantize_exclude resolved (QuantizeFlags.op_set, .exclusion)."""

    calibration_method: str
    batch_size: int
    max_accuracy_drop: float
    runtime: RuntimeOptions
    op_set: str = "default"
    exclusion: str | list[str] = field(default_factory=list)


@dataclass
class ExclusionStep:
    """One graph the automatic exclusion tried, judged on the validation split."""

    excluded: list[str]
    accuracy_val: float
    accuracy_val_fp32: float
    latency_ms_p50: float
    latency_ms_p50_fp32: float
    within_bound: bool
    faster: bool

    @property
    def accuracy_drop(self) -> float:
        return self.accuracy_val_fp32 - self.accuracy_val

    @property
    def passes(self) -> bool:
        return self.within_bound and self.faster

    @property
    def speedup(self) -> float:
        return self.latency_ms_p50_fp32 / max(self.latency_ms_p50, 1e-9)


class Quantizer:
    """Quantize one prepared graph with different nodes excluded (besides `fixed`, the nodes
    always kept in float: a detector's head and NMS), diagnose each result and judge it on the
    validation split against fp32 (timed in turns at --batch_size)."""

    def __init__(self, prepared: Path, mode: str, op_types: Sequence[str], feeds: Sequence[dict],
                 options: TrialOptions, val: Split | None, tag: str = "",
                 scorer: Scorer | None = None, fixed: Sequence[str] = (),
                 reduce_range: bool = False) -> None:
        self.prepared, self.mode, self.op_types, self.feeds = prepared, mode, op_types, feeds
        self.reduce_range = reduce_range
        self.options, self.val, self.tag = options, val, tag
        self.scorer, self.fixed = scorer or ProbabilityScorer(), list(fixed)
        self._fp32 = None
        self._fp32_val: float | None = None
        self._tries = 0

    def quantize(self, exclude: Sequence[str]) -> Path:
        self._tries += 1
        dst = self.prepared.with_name(f"int8{self.tag}_{self._tries}.onnx")
        return quantize_prepared(self.prepared, dst, self.mode, self.op_types,
                                 [*self.fixed, *exclude], self.feeds,
                                 self.options.calibration_method, self.reduce_range)

    def diagnose(self, int8: Path) -> list[LayerError]:
        """The layers, worst first; none (and a WARNING) where the diagnosis itself fails: it
        explains int8, and must not cost the run its int8 graph."""
        try:
            return diagnose(self.prepared, int8, self.feeds[:DIAGNOSIS_BATCHES], self.op_types)
        except Exception as err:  # noqa: BLE001 - ONNX Runtime's helpers fail in many ways
            LOG.warning("could not diagnose the int8 layers: %s", first_line(err))
            return []

    def val_score(self, session) -> float:
        assert self.val is not None
        x, y = self.val
        found = self.scorer.predict(session, x, self.options.batch_size)
        return self.scorer.evaluate(found, y)[self.scorer.name]

    def judge_step(self, int8: Path, excluded: Sequence[str]) -> ExclusionStep:
        """Validation score and p50 at --batch_size against fp32 (the prepared graph)."""
        assert self.val is not None
        if self._fp32 is None:
            self._fp32 = create_session(str(self.prepared), self.options.runtime)
            self._fp32_val = self.val_score(self._fp32)
        session = create_session(str(int8), self.options.runtime)
        score = self.val_score(session)
        fp32_ms, int8_ms = interleaved_p50_ms([self._fp32, session], self.val[0],
                                              self.options.batch_size, self.scorer.runner)
        return ExclusionStep(list(excluded), score, self._fp32_val, int8_ms, fp32_ms,
                             within_bound=(self._fp32_val - score
                                           <= self.options.max_accuracy_drop),
                             faster=int8_ms * MIN_SPEEDUP <= fp32_ms)


def search_exclusions(quantizer: Quantizer, int8: Path, layers: list[LayerError]
                      ) -> tuple[Path, list[LayerError], dict]:
    """--quantize_exclude auto: until int8 is within --max_accuracy_drop on the validation split
    and faster than fp32, keep the node adding the most noise (with any node measured at the same
    tensor) in fp32, quantize again, diagnose again and re-judge; stop when nothing is left to
    exclude or after MAX_EXCLUSION_STEPS. Returns the last graph, its diagnosis and the report's
    exclusion section."""
    excluded: list[str] = []
    steps = [quantizer.judge_step(int8, excluded)]
    tried = [(int8, layers)]
    while not (steps[-1].within_bound and steps[-1].faster) and len(steps) <= MAX_EXCLUSION_STEPS:
        left = [row for row in layers if row.node not in excluded]
        worst = [row.node for row in left if row.output == left[0].output] if left else []
        if len(worst) == len(left):  # excluding them would leave nothing in int8
            break
        excluded = [*excluded, *worst]
        LOG.info("int8 %s: quantizing again with %s in fp32", "is no faster than fp32"
                 if steps[-1].within_bound else f"loses {steps[-1].accuracy_drop:.4f} "
                 "validation accuracy", ", ".join(worst))
        int8 = quantizer.quantize(excluded)
        layers = quantizer.diagnose(int8)
        steps.append(quantizer.judge_step(int8, excluded))
        tried.append((int8, layers))
    kept = kept_step(steps)
    return *tried[kept], {"requested": "auto", "excluded": steps[kept].excluded,
                          "outcome": search_outcome(steps, steps[-1].excluded), "kept_step": kept,
                          "steps": [asdict(s) for s in steps]}


def kept_step(steps: Sequence[ExclusionStep]) -> int:
    """The step whose graph is written: the last when it succeeded; otherwise the fastest of
    those within the bound (the nearest to usable), or else the most accurate."""
    if steps[-1].within_bound and steps[-1].faster:
        return len(steps) - 1
    within = [k for k, step in enumerate(steps) if step.within_bound]
    if within:
        return min(within, key=lambda k: steps[k].latency_ms_p50 / steps[k].latency_ms_p50_fp32)
    return min(range(len(steps)), key=lambda k: steps[k].accuracy_drop)


def search_outcome(steps: Sequence[ExclusionStep], excluded: Sequence[str]) -> str:
    last, tried = steps[-1], f"{len(excluded)} node(s) excluded in {len(steps) - 1} step(s)"
    if last.within_bound and last.faster:
        return (f"within the bound and faster than fp32 with {tried}" if excluded else
                "within the bound and faster than fp32 with no node excluded")
    if last.within_bound and len(steps) == 1:
        return ("within the bound but not faster than fp32, and leaving out its one quantized "
                "node (or group) would leave nothing in int8")
    if last.within_bound:
        return (f"within the bound but not faster than fp32 with {tried}: no set of excluded "
                "nodes found that is both")
    return (f"still loses {last.accuracy_drop:.4f} validation accuracy with {tried}: no set of "
            "excluded nodes found within the bound")



def quantize_trials(options: TrialOptions, prepared: Path, graph: onnx.ModelProto, mode: str,
                    feeds: Sequence[dict], val: Split | None, scorer: Scorer,
                    kept: KeptFloat | None = None, reduce_range: bool = False
                    ) -> tuple[list[OpSetTrial], int]:
    """Each op set of --quantize_ops quantized (with the nodes of --quantize_exclude, or those
    it searches for, kept fp32; the nodes the model type keeps float, `kept`, besides: a
    detector's head and NMS), diagnosed and, where there is a choice, judged. `graph`: the
    prepared graph, loaded. Returns the trials and the index of the chosen one."""
    exclusion = options.exclusion
    on_val = val is not None and len(val[0]) > 0
    candidates = op_set_candidates(options.op_set, mode, {n.op_type for n in graph.graph.node})
    candidates = candidates if on_val else candidates[:1]  # nothing to judge them on
    manual = [] if exclusion == "auto" else list(exclusion)
    require_known_nodes(manual, graph, sorted({t for c in candidates for t in c}))
    trials = []
    for k, op_types in enumerate(candidates):
        quantizer = Quantizer(prepared, mode, op_types, feeds, options, val, tag=f"_{k}",
                              scorer=scorer, fixed=kept.kept_float() if kept else (),
                              reduce_range=reduce_range)
        trial = quantizer_step(mode, lambda: try_op_set(
            quantizer, manual, auto=exclusion == "auto" and on_val, judge=len(candidates) > 1))
        if kept is not None:
            section = kept.section(graph, op_types)
            trial.exclusion.update(kept_float=section, excluded=[*section["quantizable"],
                                                                 *trial.exclusion["excluded"]])
        trials.append(trial)
    return trials, choose_op_set(trials)


@dataclass
class OpSetTrial:
    """One op set quantized (its nodes excluded as asked), diagnosed and, where there is a
    choice to make, judged on the validation split."""

    op_types: list[str]
    int8: Path
    layers: list[LayerError]
    exclusion: dict
    judged: ExclusionStep | None


def try_op_set(quantizer: Quantizer, manual: Sequence[str], auto: bool, judge: bool
               ) -> OpSetTrial:
    """Quantize with the nodes in `manual` kept fp32, or search for them (`auto`)."""
    int8 = quantizer.quantize(manual)
    layers = quantizer.diagnose(int8)
    op_types = list(quantizer.op_types)
    if auto and op_types:
        int8, layers, section = search_exclusions(quantizer, int8, layers)
        kept = ExclusionStep(**section["steps"][section["kept_step"]])
        return OpSetTrial(op_types, int8, layers, section, kept)
    judged = quantizer.judge_step(int8, manual) if judge else None
    return OpSetTrial(op_types, int8, layers, {"requested": list(manual),
                                               "excluded": list(manual)}, judged)


def choose_op_set(trials: Sequence[OpSetTrial]) -> int:
    """--quantize_ops auto: the default set (the first trial) unless the validation judge
    prefers the wider one: it passes (within the bound and 5% faster than fp32) where the
    default does not, or both pass and it is 5% faster still. Returns the trial's index."""
    if len(trials) == 1:
        return 0
    default, wider = trials[0].judged, trials[1].judged
    assert default is not None and wider is not None
    if wider.passes and (not default.passes or wider.speedup >= default.speedup * MIN_SPEEDUP):
        LOG.info("int8 keeps every quantizable op type (%.2fx fp32's speed on validation, "
                 "against %.2fx with %s)", wider.speedup, default.speedup,
                 ", ".join(trials[0].op_types))
        return 1
    return 0


def op_sets_section(trials: Sequence[OpSetTrial], chosen: int) -> list[dict] | None:
    """The report's quantize.op_sets: each set tried, as judged, and which was kept."""
    if len(trials) < 2:
        return None
    return [{"op_types": t.op_types, **asdict(t.judged), "kept": k == chosen}
            for k, t in enumerate(trials) if t.judged is not None]

