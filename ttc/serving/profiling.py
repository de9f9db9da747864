"""--profile: ONNX Runtime's own profiler on the graph that serves, read into where the time goes.

ONNX Runtime writes one Chrome-tracing JSON file per session (SessionOptions.enable_profiling):
a "Session" event per run ("model_run") and, per node and run, a "Node" event named
"<node>_kernel_time" whose args carry the op type. We run the graph on real batches under the
profiler, drop the first (warm-up) run, and sum each node's kernel time: the ten most expensive
nodes and the time per op type go into the report, the raw trace beside it (chrome://tracing or
https://ui.perfetto.dev open it).

A leaf module beside runtime.py: numpy, utils and runtime only.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ttc.serving.runtime import RuntimeOptions, create_session, session_runner
from utils import RuntimeFailure

TOP_NODES = 10
PROFILED_RUNS = 20  # batches each profiled graph runs (after one warm-up batch)
KERNEL_SUFFIX = "_kernel_time"


@dataclass
class Profile:
    """Kernel time per node over the profiled runs (the warm-up run left out), in ms."""

    runs: int
    run_ms: list[float]
    batch_size: int
    node_ms: dict[str, float] = field(default_factory=dict)
    node_calls: dict[str, int] = field(default_factory=dict)
    op_type: dict[str, str] = field(default_factory=dict)

    def op_type_ms(self) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for node, ms in self.node_ms.items():
            totals[self.op_type[node]] += ms
        return dict(totals)


def read_trace(path: str | Path, batch_size: int = 0) -> Profile:
    """An ONNX Runtime trace file → Profile; the first run is a warm-up (allocations, kernel
    selection) and is left out when there are others."""
    try:
        events = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RuntimeFailure(f"cannot read ONNX Runtime's profile {path}: {err}",
                             "run again with --log_level DEBUG to see ONNX Runtime's messages")
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])
    skip_until = runs[0]["ts"] + runs[0]["dur"] if len(runs) > 1 else -1
    profile = Profile(runs=len(runs[1:]) if len(runs) > 1 else len(runs),
                      run_ms=[e["dur"] / 1e3 for e in (runs[1:] if len(runs) > 1 else runs)],
                      batch_size=batch_size)
    for event in events:
        name = str(event.get("name", ""))
        if event.get("cat") != "Node" or not name.endswith(KERNEL_SUFFIX):
            continue
        if event["ts"] <= skip_until:
            continue
        node = name[:-len(KERNEL_SUFFIX)]
        profile.node_ms[node] = profile.node_ms.get(node, 0.0) + event["dur"] / 1e3
        profile.node_calls[node] = profile.node_calls.get(node, 0) + 1
        profile.op_type[node] = str(event.get("args", {}).get("op_name", "?"))
    return profile


def profiled_batches(batches: Sequence[np.ndarray], runs: int = PROFILED_RUNS
                     ) -> list[np.ndarray]:
    """`runs` batches: the first ones, repeated in turn when there are fewer."""
    if not batches:
        raise RuntimeFailure("no samples to profile", "check the data the graph runs on")
    return (list(batches) * -(-runs // len(batches)))[:runs]


def profile_runs(model: str | bytes, runtime: RuntimeOptions, batches: Sequence[np.ndarray],
                 trace_to: Path | None,
                 runner: Callable[[object], Callable[[np.ndarray], object]] = session_runner
                 ) -> Profile:
    """One warm-up batch and then `batches`, each once, through a session made with ONNX
    Runtime's profiler on; the trace is moved to `trace_to` (atomically: a user's earlier trace
    is replaced whole or not at all) or deleted. Nothing is left in the working directory."""
    with tempfile.TemporaryDirectory(prefix="ttc-profile-") as scratch:
        session = create_session(model, runtime, profile_prefix=str(Path(scratch) / "ort"))
        run = runner(session)
        for batch in [batches[0], *batches]:
            run(batch)
        written = Path(session.end_profiling())
        del session
        profile = read_trace(written, len(batches[0]))
        if trace_to is not None:
            keep_trace(written, trace_to)
    return profile


def keep_trace(written: Path, trace_to: Path) -> None:
    """Move ONNX Runtime's trace beside the report through a temporary file in the target's
    folder (os.replace is atomic only within one file system)."""
    trace_to.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{trace_to.name}.", dir=trace_to.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(written.read_bytes())
        os.replace(temporary, trace_to)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def profile_section(profile: Profile, trace: Path | None, top: int = TOP_NODES) -> dict:
    """The report's "profile" section: the `top` nodes by kernel time and the time per op type,
    each with its share of all kernel time (so the shares sum to at most 1)."""
    total = sum(profile.node_ms.values()) or 1e-12
    runs = max(profile.runs, 1)
    nodes = sorted(profile.node_ms, key=profile.node_ms.get, reverse=True)[:top]
    by_op = sorted(profile.op_type_ms().items(), key=lambda kv: kv[1], reverse=True)
    return {
        "trace": str(trace) if trace is not None else None,
        "runs": profile.runs, "batch_size": profile.batch_size,
        # the mean, as every kernel figure is: a median beside kernel means let the kernels of
        # a run with one slow outlier add up to more than the run
        "ms_per_run": round(float(np.mean(profile.run_ms)), 4) if profile.run_ms else None,
        "node_ms_per_run": round(sum(profile.node_ms.values()) / runs, 4),
        "top": [{"node": node, "op_type": profile.op_type[node],
                 "total_ms": round(profile.node_ms[node], 4),
                 "ms_per_run": round(profile.node_ms[node] / runs, 4),
                 "share": round(profile.node_ms[node] / total, 4),
                 "calls": profile.node_calls[node]} for node in nodes],
        "by_op_type": [{"op_type": op, "ms_per_run": round(ms / runs, 4),
                        "share": round(ms / total, 4)} for op, ms in by_op],
    }


def grown_op_types(fp32: Profile, variant: Profile, top: int = 3) -> list[dict]:
    """The op types whose kernel time per run is larger in `variant` than in fp32 (a type new in
    the variant, such as ConvInteger or DequantizeLinear, grew from 0), most growth first."""
    before = {op: ms / max(fp32.runs, 1) for op, ms in fp32.op_type_ms().items()}
    after = {op: ms / max(variant.runs, 1) for op, ms in variant.op_type_ms().items()}
    grown = [(op, before.get(op, 0.0), ms, ms - before.get(op, 0.0)) for op, ms in after.items()]
    grown = sorted((g for g in grown if g[3] > 0), key=lambda g: g[3], reverse=True)[:top]
    return [{"op_type": op, "ms_per_run_fp32": round(was, 4), "ms_per_run": round(now, 4),
             "grew_ms": round(grew, 4)} for op, was, now, grew in grown]

