"""Test-time augmentation on the ONNX model: small composable transforms (after ttach), merge
rules, adaptive triggering. No torch: inference stays lean.

A transform turns a batch into extra views, as ONNX nodes (tta_graph.py puts them in front of the
model and the merge behind it: one session.run per chunk, the `graph` plan) and as a numpy twin
(the reference the tests hold the graph to, the path for window:N, and the `loop` plan: one
session.run per view); tta_runner times both plans at load and keeps the faster (--tta_plan).
A transform may give several views per sample (rotate:DEG gives ±DEG, shift:PX four shifts,
window:N one per window of a long text); numpy views keep the index of the sample each came
from (`owner`). The plain view is always
included. Each transform also has a `random` form, used to train on the same distortions.
Each transform name is one class in transforms.py's TRANSFORMS (the vocabulary every model type
shares; this module runs a classifier's compiled form); each merge rule, in numpy and as graph
nodes, one entry of MERGES.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np
import onnx

from ttc.testtime import tta_graph
from ttc.inputs.preprocess import PAD_ID, trim_padding
from ttc.serving.runtime import batches_of, best_of, create_session, session_runner
from ttc.tasks.registry import TASKS, task_of_kind
from ttc.testtime.transforms import (TTATransform, Transform, accepted, pad_id,
                                     parse_transform_specs as parse_entries, training_spec)
from ttc.testtime.transforms import transform as transform_named
from ttc.testtime.tta_graph import ViewBuilder
from utils import LOG, ConfigError

if TYPE_CHECKING:
    import onnxruntime as ort

    from ttc.serving.manifest import Manifest
    from ttc.serving.runtime import RuntimeOptions



# ----------------------------------------------------------------------------- transforms

# The transforms themselves, one class each, are the one vocabulary every model type shares
# (transforms.py); a classifier runs their compiled form (transforms.Transform).
REGISTRY: dict[str, dict[str, type[TTATransform]]] = {
    task.kind: accepted(task.kind) for task in TASKS}


def parse_transform_specs(text: str, kind: str) -> list[tuple[str, float | None]]:
    """'hflip,rotate:10' → [('hflip', None), ('rotate', 10.0)]; exit 2 on anything invalid (an
    empty text is the model type's default_tta)."""
    return parse_entries(text, kind, task_of_kind(kind).default_tta)


def build_transforms(text: str, preprocessing: dict, seed: int = 0) -> list[Transform]:
    """The transforms of a --tta_transforms list; seeded ones draw from `seed`, each its own.
    `auto:LIST` is LIST here and a bare `auto` the model type's default views: what training's
    random forms use (the views served are chosen on held-out data: tta_policy.py)."""
    kind = preprocessing["kind"]
    text = training_spec(text)
    return [transform_named(name, value).compile(preprocessing, np.random.default_rng([seed, k]))
            for k, (name, value) in enumerate(parse_transform_specs(text, kind))]


def view_sets(x: np.ndarray, transforms: Sequence[Transform]
              ) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """The plain view, then every transform's views of a batch, one array at a time: (view, the
    owner row of each of its rows), the owners None where the view covers the whole batch in
    order. What `expand` stacks and the loop plan runs one at a time."""
    yield x, None
    for transform in transforms:
        if transform.ragged is not None:
            windowed, rows = transform.ragged(x)
            if len(rows):
                yield windowed, rows
            continue
        for view in transform.views(x):
            yield view, None


def expand(x: np.ndarray, transforms: Sequence[Transform]
           ) -> tuple[np.ndarray, np.ndarray | None]:
    """The plain view plus every transform's views of a batch: (views, owner row of each), the
    owners None when every view covers the whole batch in order (the common, fast case)."""
    views, owners = zip(*view_sets(x, transforms))
    return _stack(list(views), pad_id_of(transforms)), _owners(owners, len(x))


def _owners(owners: Sequence[np.ndarray | None], n: int) -> np.ndarray | None:
    """The owner row of every stacked view row (view_sets' owners joined), or None where every
    view covers the whole batch in order."""
    if all(o is None for o in owners):
        return None
    return np.concatenate([np.arange(n) if o is None else o for o in owners])


def tta_model(model: onnx.ModelProto, transforms: Sequence[Transform], merge_mode: str,
              classes: int) -> onnx.ModelProto | None:
    """The bundle's graph with the views in front and the merge behind (tta_graph.with_tta), or
    None where the views cannot live in the graph (window:N, whose view count depends on each
    text's length, or a graph older than opset 18): then numpy builds the views."""
    if any(t.graph is None for t in transforms):
        return None
    try:
        return tta_graph.with_tta(model, _graph_builders(transforms),
                                  views_per_sample(transforms), classes,
                                  _merge_rule(merge_mode).graph)
    except ValueError as err:
        LOG.info("TTA views built in numpy: %s", err)
        return None


def _graph_builders(transforms: Sequence[Transform]) -> list[ViewBuilder]:
    """Each transform's nodes, except that a run of seeded ones of one kind (token_dropout,
    jitter) shares one set of nodes over its stacked masks or noise: at batch 1 a graph's time
    is mostly per-node overhead."""
    builders: list[ViewBuilder] = []
    for _, run in itertools.groupby(transforms, key=lambda t: (t.name, t.stacked_graph is None)):
        run = list(run)
        if run[0].stacked_graph is None:
            builders += [t.graph for t in run]  # type: ignore[misc]
        else:
            stack, build = np.stack([t.constant for t in run]), run[0].stacked_graph
            builders.append(lambda g, x, stack=stack, build=build: [build(g, x, stack)])
    return builders


def views_per_sample(transforms: Sequence[Transform]) -> int:
    """How many views a sample gets (windows counted as one)."""
    return 1 + sum(t.count for t in transforms)


def pad_id_of(transforms: Sequence[Transform]) -> int:
    """The padding id the token views were built for (the bundle's; 0 for other kinds)."""
    return next((t.pad_id for t in transforms), PAD_ID)


def _stack(views: list[np.ndarray], pad_id: int = PAD_ID) -> np.ndarray:
    """Concatenate along the batch axis; token ids of different lengths are right-padded."""
    if views[0].dtype == np.int64 and views[0].ndim == 2:
        width = max(v.shape[1] for v in views)
        views = [np.pad(v, ((0, 0), (0, width - v.shape[1])), constant_values=pad_id)
                 for v in views]
    return np.ascontiguousarray(np.concatenate(views))


def random_augment(x: np.ndarray, transforms: Sequence[Transform], rng: np.random.Generator
                   ) -> np.ndarray:
    """Training: each sample keeps its plain form or takes one transform's random form."""
    if not transforms:
        return x
    choice = rng.integers(0, len(transforms) + 1, len(x))
    out = x.copy()
    for k, transform in enumerate(transforms, start=1):
        chosen = choice == k
        if chosen.any():
            out[chosen] = _fit_width(transform.random(x[chosen], rng), x.shape)
    return out


def _fit_width(view: np.ndarray, shape: tuple) -> np.ndarray:
    return view if view.shape[1:] == shape[1:] else view[:, : shape[1]]


# ----------------------------------------------------------------------------- merging


@dataclass(frozen=True)
class _Views:
    """A batch's view rows, reduced to one row per sample: `owners[i]` is the sample of row i;
    None means whole-batch views stacked in order (blocks of n rows, the fast path)."""

    n: int
    owners: np.ndarray | None

    def mean(self, values: np.ndarray) -> np.ndarray:
        if self.owners is None:
            return values.reshape(-1, self.n, values.shape[1]).mean(0)
        total = np.zeros((self.n, values.shape[1]))
        np.add.at(total, self.owners, values)
        return total / np.bincount(self.owners, minlength=self.n).astype(np.float64)[:, None]

    def max(self, values: np.ndarray) -> np.ndarray:
        if self.owners is None:
            return values.reshape(-1, self.n, values.shape[1]).max(0)
        out = np.full((self.n, values.shape[1]), -np.inf)
        np.maximum.at(out, self.owners, values)
        return out


@dataclass(frozen=True)
class Merge:
    """A --tta_merge rule: `numpy` turns the view rows (float64) into per-sample scores (merge
    normalises them), `graph` builds the same rule as ONNX nodes."""

    numpy: Callable[[np.ndarray, _Views], np.ndarray]
    graph: tta_graph.GraphMerge


def _vote(p: np.ndarray, views: _Views) -> np.ndarray:
    """The share of views voting each class; ties go to the higher mean probability."""
    return views.mean(np.eye(p.shape[1])[p.argmax(1)]) + 1e-6 * views.mean(p)


MERGES: dict[str, Merge] = {
    "mean": Merge(lambda p, views: views.mean(p), tta_graph.merge_mean),
    "gmean": Merge(lambda p, views: np.exp(views.mean(np.log(np.clip(p, 1e-12, 1)))),
                   tta_graph.merge_gmean),
    "max": Merge(lambda p, views: views.max(p), tta_graph.merge_max),
    "vote": Merge(_vote, tta_graph.merge_vote),
    # ttach's temperature sharpening, t = 0.5
    "tsharpen": Merge(lambda p, views: views.mean(np.sqrt(p)), tta_graph.merge_tsharpen),
}
MERGE_MODES = tuple(MERGES)


def _merge_rule(mode: str) -> Merge:
    if mode not in MERGES:
        raise ConfigError(f"unknown --tta_merge {mode!r}", f"use one of {', '.join(MERGE_MODES)}")
    return MERGES[mode]


def merge(probs: np.ndarray, owners: np.ndarray | None, n: int, mode: str) -> np.ndarray:
    """Per sample, combine its views' probabilities into one distribution (rows sum to 1).

    owners[i] is the sample of row i; None means whole-batch views stacked in order."""
    out = _merge_rule(mode).numpy(probs.astype(np.float64), _Views(n, owners))
    return (out / out.sum(axis=1, keepdims=True)).astype(np.float32)


# ----------------------------------------------------------------------------- running


Predict = Callable[[np.ndarray], np.ndarray]


@dataclass
class TTAOutcome:
    probabilities: np.ndarray
    plain: np.ndarray
    triggered: np.ndarray  # bool per sample: did it get the extra views
    seconds: float
    seconds_plain: float
    views: int  # views per sample (plain included), as run


@dataclass(frozen=True)
class TTAOptions:
    """What TTA takes from the flags (Config.tta_options)."""

    transforms: str
    merge: str
    threshold: float | None
    batch_size: int
    seed: int
    plan: str = "auto"  # --tta_plan: auto (timed at load), graph or loop


PLANS = ("graph", "loop")  # how the views run: all in one session.run, or one run per view
PLAN_CHOICES = ("auto", *PLANS)
PLAN_TIMED_RUNS = 3  # timed turns per plan at load (after one untimed turn), best of


@dataclass(frozen=True)
class PlanTimings:
    """The two plans timed at load on one batch of the run's batch size, best of a few turns."""

    graph_ms: float
    loop_ms: float
    batch_size: int
    clock: str = "wall"  # cpu: this process's CPU time (one CPU thread); wall: elapsed time

    @property
    def faster(self) -> str:
        return "loop" if self.loop_ms < self.graph_ms else "graph"

    def report(self) -> dict:
        return {"graph_ms": round(self.graph_ms, 4), "loop_ms": round(self.loop_ms, 4),
                "batch_size": self.batch_size, "clock": self.clock}


@dataclass
class TTARunner:
    """How TTA runs. Plan `graph`: every view of a chunk in one session.run: `merged` runs the
    TTA graph (views, model and merge in one graph); without it numpy stacks the views for
    `predict` (the plain graph) and merges its output. Plan `loop`: numpy builds one view at a
    time, `predict` runs each (batch_size rows), numpy merges (what ttach does in PyTorch). Both
    give the same probabilities; which is faster depends on the model and the batch size
    (choose_plan times them)."""

    predict: Predict
    transforms: Sequence[Transform]
    merge_mode: str
    batch_size: int
    merged: Predict | None = None
    plan: str = "graph"
    plan_timings: PlanTimings | None = None  # None: the plan was not timed (--tta_plan given)

    @property
    def backend(self) -> str:
        """Where the graph plan builds the views: in the TTA graph, or numpy."""
        return "onnx_graph" if self.merged is not None else "numpy"

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Merged probabilities, chunk by chunk. A chunk is batch_size samples, except for token
        ids under the graph plan: batch_size / views texts, so that its one run of all the views
        pads only to the chunk's own longest text (SMS, 4 views, batch 64: TTA cost 4.6x plain
        with 64-text chunks, 3.0x with 16)."""
        out = []
        step = self.batch_size
        if x.dtype == np.int64 and x.ndim == 2 and self.plan == "graph":
            step = max(1, self.batch_size // views_per_sample(self.transforms))
        for start in range(0, len(x), step):
            chunk = x[start:start + step]
            if chunk.dtype == np.int64 and chunk.ndim == 2:  # token ids: drop unused padding
                chunk = trim_padding(chunk, pad_id_of(self.transforms))
            chunk = np.ascontiguousarray(chunk)
            out.append(self._loop(chunk) if self.plan == "loop" else self._run_chunk(chunk))
        return np.concatenate(out) if out else np.zeros((0, 0), np.float32)

    def _run_chunk(self, chunk: np.ndarray) -> np.ndarray:
        if self.merged is not None:
            return self.merged(chunk)
        stacked, owners = expand(chunk, self.transforms)
        return merge(self.predict(self._fed(stacked)), owners, len(chunk), self.merge_mode)

    def _loop(self, chunk: np.ndarray) -> np.ndarray:
        """One session.run per view (window:N's views of a chunk: one run), merged by numpy."""
        probs, owners = [], []
        for view, rows in view_sets(chunk, self.transforms):
            probs.append(self.predict(self._fed(view)))
            owners.append(rows)
        return merge(np.concatenate(probs), _owners(owners, len(chunk)), len(chunk),
                     self.merge_mode)

    def _fed(self, views: np.ndarray) -> np.ndarray:
        """Views as a session takes them: contiguous, token ids without unused padding."""
        if views.dtype == np.int64 and views.ndim == 2:
            views = trim_padding(views, pad_id_of(self.transforms))
        return np.ascontiguousarray(views)

    def with_plan(self, plan: str, timings: PlanTimings | None = None) -> TTARunner:
        """The same runner (sessions shared) running `plan`."""
        if plan not in PLANS:
            raise ConfigError(f"unknown --tta_plan {plan!r}",
                              f"use one of {', '.join(PLAN_CHOICES)}")
        return replace(self, plan=plan, plan_timings=timings)

    def run(self, x: np.ndarray, threshold: float | None = None) -> TTAOutcome:
        """Plain predictions (timed), then TTA (timed): on every sample, or with `threshold`
        only on samples whose plain top probability is below it (TTA time then includes the
        plain pass)."""
        seconds_plain, plain = best_of(1, lambda: np.concatenate(
            [self.predict(b) for b in batches_of(x, self.batch_size, pad_id_of(self.transforms))]))
        triggered = (plain.max(1) < threshold) if threshold is not None else np.ones(len(x), bool)
        merged = plain.copy()
        rows = np.flatnonzero(triggered)

        def augment_triggered() -> None:
            if len(rows):
                merged[rows] = self(x[rows])

        seconds, _ = best_of(1, augment_triggered)
        seconds += seconds_plain if threshold is not None else 0
        return TTAOutcome(merged, plain, triggered, seconds, seconds_plain,
                          views_per_sample(self.transforms))

    def cost_ratio(self, x: np.ndarray, threshold: float | None, repeats: int = 3) -> float:
        """TTA time / plain time over the split, each the best of `repeats` alternating passes
        (the first outcome already warmed both paths up)."""
        outcomes = [self.run(x, threshold) for _ in range(repeats)]
        plain = min(o.seconds_plain for o in outcomes)
        return round(min(o.seconds for o in outcomes) / max(plain, 1e-9), 3)


@dataclass
class TTAResult:
    transforms: list[str]
    merge: str
    views: int
    accuracy: float
    accuracy_plain: float
    fixed: int
    broken: int
    cost_ratio: float
    triggered_fraction: float
    threshold: float | None
    backend: str = "numpy"  # onnx_graph: the graph plan's views and merge are ONNX nodes
    plan: str = "graph"  # graph: all views in one session.run; loop: one run per view
    plan_timings: dict | None = None  # both plans timed at load (None: --tta_plan chose)
    accuracy_val: float | None = None
    accuracy_val_plain: float | None = None
    verdict: str = ""

    def report_section(self) -> dict:
        return dict(vars(self))

    def judged(self) -> tuple[str, float, float]:
        """The split TTA is judged on (validation when there is one), TTA and plain accuracy."""
        if self.accuracy_val is not None and self.accuracy_val_plain is not None:
            return "validation", self.accuracy_val, self.accuracy_val_plain
        return "test", self.accuracy, self.accuracy_plain

    @property
    def lowers(self) -> bool:
        _, with_tta, plain = self.judged()
        return with_tta < plain


def evaluate_tta(runner: TTARunner, test: tuple[np.ndarray, np.ndarray],
                 val: tuple[np.ndarray, np.ndarray] | None, threshold: float | None
                 ) -> TTAResult:
    """TTA vs plain on the test split (and the validation split, to judge it honestly)."""
    x, y = test
    outcome = runner.run(x, threshold)
    right_tta = outcome.probabilities.argmax(1) == y
    right_plain = outcome.plain.argmax(1) == y
    result = TTAResult(
        transforms=[t.spec for t in runner.transforms], merge=runner.merge_mode,
        views=outcome.views, accuracy=float(right_tta.mean()),
        accuracy_plain=float(right_plain.mean()), fixed=int((right_tta & ~right_plain).sum()),
        broken=int((~right_tta & right_plain).sum()), cost_ratio=runner.cost_ratio(x, threshold),
        triggered_fraction=float(outcome.triggered.mean()), threshold=threshold,
        backend=runner.backend, plan=runner.plan,
        plan_timings=runner.plan_timings.report() if runner.plan_timings else None)
    if val is not None and len(val[1]):
        checked = runner.run(val[0], threshold)
        result.accuracy_val = float((checked.probabilities.argmax(1) == val[1]).mean())
        result.accuracy_val_plain = float((checked.plain.argmax(1) == val[1]).mean())
    split, judged, plain = result.judged()
    if result.lowers:
        result.verdict = (f"TTA lowers {split} accuracy ({judged:.4f} vs {plain:.4f} without); "
                          "try other --tta_transforms (flips and rotations change what digits "
                          "and text mean), another --tta_merge, or --tta false")
    else:
        result.verdict = (f"TTA {'raises' if judged > plain else 'keeps'} {split} accuracy "
                          f"({judged:.4f} vs {plain:.4f} without) at {result.cost_ratio:.2f}x the "
                          "time")
    return result


def tta_runner(session: ort.InferenceSession, model_path: Path, manifest: Manifest,
               options: TTAOptions, runtime: RuntimeOptions, rows: np.ndarray | None = None,
               chosen: tuple[Sequence[Transform], str] | None = None) -> TTARunner:
    """TTA on the chosen graph: in one ONNX graph with the views and the merge (a second session
    on the same providers) where the transforms allow, else numpy views around `session`; run
    by the plan --tta_plan names, or with auto the faster one on a batch of `rows` (the first
    batch_size of them, repeated where fewer; None: rows made up from the manifest). `chosen`:
    the views and merge a policy search chose (tta_policy.py), in place of the flags'."""
    transforms, merge_mode = chosen or (
        build_transforms(options.transforms, manifest.preprocessing.spec, options.seed),
        options.merge)
    merged = None
    if transforms:  # no extra view: the plain graph is the whole of it
        model = tta_model(onnx.load(str(model_path)), transforms, merge_mode, manifest.classes)
        if model is not None:
            merged = session_runner(create_session(model.SerializeToString(), runtime,
                                                   classes=manifest.classes, source=model_path))
    runner = TTARunner(session_runner(session), transforms, merge_mode, options.batch_size,
                       merged)
    if options.plan != "auto":
        LOG.info("TTA plan: %s (--tta_plan)", options.plan)
        return runner.with_plan(options.plan)
    probe = probe_rows(rows, manifest, options.batch_size, options.seed)
    return choose_plan(runner, probe, plan_clock(session, runtime))


def choose_plan(runner: TTARunner, probe: np.ndarray, clock: str = "wall") -> TTARunner:
    """The runner with the faster plan on `probe` (one batch), both timed by `clock` and
    recorded; a runner without extra views keeps the graph plan (one run either way)."""
    if views_per_sample(runner.transforms) == 1:
        return runner
    timings = time_plans(runner, probe, clock)
    LOG.info("TTA plan: %s (batch of %d, %s time: all views in one session.run %.3f ms, one "
             "run per view %.3f ms)", timings.faster, timings.batch_size, timings.clock,
             timings.graph_ms, timings.loop_ms)
    return runner.with_plan(timings.faster, timings)


def plan_clock(session: ort.InferenceSession, runtime: RuntimeOptions) -> str:
    """What the plans are timed by: "cpu", this process's CPU time, where ONNX Runtime runs on
    one CPU thread (what a run costs however busy the machine is: elapsed time then also counts
    the waits for other processes, which hit a long run more often than a short one); else
    "wall", elapsed time (a GPU, several threads)."""
    cpu_only = list(session.get_providers()) == ["CPUExecutionProvider"]
    return "cpu" if cpu_only and runtime.intra_op_threads == 1 else "wall"


def time_plans(runner: TTARunner, probe: np.ndarray, clock: str = "wall",
               runs: int = PLAN_TIMED_RUNS) -> PlanTimings:
    """Both plans on the same batch in turns, each turn in the other order, after one untimed
    turn (ONNX Runtime sizes its buffers for the batch): the best of `runs` turns each."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    plans = [runner.with_plan(plan) for plan in PLANS]
    best = [math.inf] * len(plans)
    for turn in range(1 + runs):
        for k in (range(len(plans)) if turn % 2 else reversed(range(len(plans)))):
            start = now()
            plans[k](probe)
            if turn:
                best[k] = min(best[k], now() - start)
    return PlanTimings(best[0] * 1e3, best[1] * 1e3, len(probe), clock)


def probe_rows(rows: np.ndarray | None, manifest: Manifest, batch_size: int, seed: int = 0
               ) -> np.ndarray:
    """A batch of batch_size rows to time the plans on: the first of `rows` (repeated where
    there are fewer), else made up from the manifest: pixels in [0, 1), standard normal
    features, or 32 token ids drawn from the vocabulary (no padding or special id)."""
    if rows is not None and len(rows):
        picked = rows[np.arange(batch_size) % len(rows)]
        if picked.dtype == np.int64 and picked.ndim == 2:
            picked = trim_padding(picked, manifest.input.pad_id)
        return np.ascontiguousarray(picked)
    rng = np.random.default_rng(seed)
    pre = manifest.preprocessing.spec
    if pre["kind"] == "image":
        shape = (int(pre["channels"]), *map(int, pre["image_size"]))
        return rng.random((batch_size, *shape), dtype=np.float32)
    if pre["kind"] == "text":
        return _probe_ids(pre, batch_size, rng)
    features = len(pre.get("feature_names", ())) or int(manifest.input.shape[-1])
    return rng.standard_normal((batch_size, features)).astype(np.float32)


def _probe_ids(pre: dict, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    length = min(32, int(pre.get("max_length", 32)))
    vocab = int(pre.get("vocab_size", 2))
    ids = rng.integers(0, vocab, (batch_size, length))
    reserved = [pad_id(pre), *pre.get("special_ids", ())]
    return np.where(np.isin(ids, reserved), int(pre.get("unk_id", 1)), ids).astype(np.int64)
