"""Test-time training on a stream (`--eval_stream ORDER --stream_passes N`): the test split, clean
and under each --eval_shift corruption, put in one order and adapted to batch by batch, pass
after pass (online adaptation goes on from pass to pass), with each method that applies, without
the guard and with --ttt_guard. The report's `ttt.stream` gives each run's accuracy per pass next
to the source model's, and what the guard did.

The orders: `shuffled` (exchangeable: what the guard must leave alone), `label_sorted` (class
by class, the worst case for batch statistics: DequanWang/tent #7, mariodoebler/
test-time-adaptation #5) and `dirichlet:ALPHA` (each class spread over the stream's batches in
shares drawn from Dirichlet(ALPHA): small ALPHA, few classes per batch; the non-i.i.d. streams of
Gong et al. 2022's NOTE)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ttc.inputs.shifts import corrupt, parse_stream_order
from ttc.reporting.metrics import accuracy
from utils import LOG

if TYPE_CHECKING:
    from ttc.testtime.ttt import AdaptationGraph, Tent, TTTSettings

def stream_order(y: np.ndarray, order: str, batch_size: int, seed: int) -> np.ndarray:
    """The indices of the split in stream order."""
    rng = np.random.default_rng(seed)
    name, alpha = parse_stream_order(order)
    if name == "shuffled":
        return rng.permutation(len(y))
    if name == "label_sorted":
        return np.argsort(y, kind="stable")
    slots = max(1, -(-len(y) // batch_size))
    slot_of = np.empty(len(y), np.int64)
    for label in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == label))
        shares = rng.dirichlet(np.full(slots, alpha))
        slot_of[members] = np.repeat(np.arange(slots), rng.multinomial(len(members), shares))
    by_slot = np.argsort(slot_of, kind="stable")
    return np.concatenate([rng.permutation(by_slot[slot_of[by_slot] == s])
                           for s in range(slots)])


def source_accuracy(graph: AdaptationGraph, x: np.ndarray, y: np.ndarray,
                    batch_size: int) -> float:
    """The unadapted model's accuracy on the stream (the same on every pass)."""
    from ttc.testtime.ttt import SOURCE_PRIOR, ttt_batches

    batches = ttt_batches(x, batch_size, graph.pad_id)
    return accuracy(np.concatenate([graph.run(b, SOURCE_PRIOR, {})[0] for b in batches]), y)


def stream_run(settings: TTTSettings, graph: AdaptationGraph, tent: Tent | None, method: str,
               guard_mode: str, x: np.ndarray, y: np.ndarray) -> dict:
    """One method with one guard over `settings.stream_passes` passes of the stream."""
    from dataclasses import replace

    from ttc.testtime.ttt import OnlineCarry

    guarded = replace(settings, guard=guard_mode)
    carry, guard = OnlineCarry(), guarded.new_guard()
    filtered_before = tent.filtered if tent is not None else 0
    if tent is not None:
        tent.filter_unreliable = guard_mode == "filter"
    per_pass, resets, skipped = [], 0, 0
    for _ in range(settings.stream_passes):
        adapted = guarded.run(graph, method, x, tent, carry, guard)
        per_pass.append(accuracy(adapted.probabilities, y))
        resets, skipped = resets + adapted.resets, skipped + adapted.skipped
    run = {"method": method, "guard": guard_mode, "accuracy_per_pass": per_pass,
           "resets": resets, "skipped": skipped}
    if tent is not None and method == "tent":
        run["samples_filtered"] = tent.filtered - filtered_before
    return run


def evaluate_stream(settings: TTTSettings, graph: AdaptationGraph, tent: Tent | None,
                    x: np.ndarray, y: np.ndarray, preprocessing: dict) -> dict:
    """The report's `ttt.stream`: on the test split clean and under each --eval_shift
    corruption (the shift suite's copies, same seed), per method that applies and per guard
    (none, and --ttt_guard when it is not none), the accuracy on every pass of the stream."""
    cases = [("clean", x)] + [(name, corrupt(x, name, settings.severity, preprocessing,
                                             settings.seed)) for name in settings.shifts]
    methods = graph.applicable(settings.methods)
    order = stream_order(y, settings.stream, settings.batch_size, settings.seed)
    guards = list(dict.fromkeys(["none", settings.guard]))
    runs = []
    filtering = tent.filter_unreliable if tent is not None else False
    for name, data in cases:
        stream_x, labels = data[order], y[order]
        source = source_accuracy(graph, stream_x, labels, settings.batch_size)
        for method in methods:
            for guard_mode in guards:
                run = stream_run(settings, graph, tent, method, guard_mode, stream_x, labels)
                runs.append({"shift": name, **run,
                             "source_accuracy_per_pass": [source] * settings.stream_passes})
                LOG.info("ttt stream %s, %s, guard %s: %s (source %.4f)", name, method,
                         guard_mode, " ".join(f"{a:.4f}" for a in run["accuracy_per_pass"]),
                         source)
    if tent is not None:
        tent.filter_unreliable = filtering
    return {"order": settings.stream, "passes": settings.stream_passes, "mode": settings.mode,
            "batch_size": settings.batch_size, "runs": runs}
