"""Two sets of runs, key by key: did a refactor change what the tool does? For each run folder
present in both BEFORE and AFTER (each holding NAME/report.json and NAME/model.*), prints every
report value that differs (timings, paths and the host's figures left out: they differ run to
run) and whether each bundle file is byte-identical (model.pt compared tensor by tensor, since
torch's zip records nothing else that matters here).

    python bench/compare_runs.py BEFORE AFTER
    python bench/compare_runs.py --quick      # builtin:iris trained twice here, compared

Exit 0 when nothing but timings differ, 1 otherwise. Issue 63's comparison (the README main
job, a text, a tabular, a segmenter and a detector run, before and after the stages moved
behind the model types' Parts) is in docs/benchmarks.md."""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

# Keys whose values are measurements of this host at this moment, or paths of the run folder.
VOLATILE = ("seconds", "latency", "throughput", "_ms", "ms_", "per_s", "path", "model", "html",
            "plots", "date", "created", "speedup", "timed", "p50", "p95", "p99", "rss", "memory",
            "time", "version", "cpu", "sha256", "hash", "page", "profile", "cache", "faster",
            "slower", "benchmark", "report_json", "output", "cost_ratio")

TIMES = re.compile(r"\d+(\.\d+)?x\b")


def volatile(path: str) -> bool:
    last = path.rsplit(".", 1)[-1].lower()
    return any(word in last for word in VOLATILE)


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from leaves(inner, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list) and value and all(isinstance(v, (dict, list)) for v in value):
        for k, inner in enumerate(value):
            yield from leaves(inner, f"{path}[{k}]")
    else:
        yield path, value


def same(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):  # "at 1.51x the time": a timing in words
        return TIMES.sub("Nx", a) == TIMES.sub("Nx", b)
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def report_differences(before: Path, after: Path) -> tuple[int, list[str]]:
    old = dict(leaves(json.loads(before.read_text())))
    new = dict(leaves(json.loads(after.read_text())))
    lines, compared = [], 0
    for key in sorted(old.keys() | new.keys()):
        if any(volatile(part) for part in key.replace("[", ".").split(".")):
            continue
        compared += 1
        if key not in old or key not in new:
            lines.append(f"  {key}: {'only after' if key not in old else 'only before'}")
        elif not same(old[key], new[key]):
            lines.append(f"  {key}: {str(old[key])[:80]} -> {str(new[key])[:80]}")
    return compared, lines


def same_weights(before: Path, after: Path) -> bool:
    import torch

    old = torch.load(before, map_location="cpu", weights_only=True)
    new = torch.load(after, map_location="cpu", weights_only=True)
    old = old.get("state_dict", old) if isinstance(old, dict) else old
    new = new.get("state_dict", new) if isinstance(new, dict) else new
    if not isinstance(old, dict) or old.keys() != new.keys():
        return False
    return all(not torch.is_tensor(old[k]) or torch.equal(old[k], new[k]) for k in old)


def bundle_differences(before: Path, after: Path) -> list[str]:
    lines = []
    for old in sorted(before.glob("model*")):
        new = after / old.name
        if not new.exists():
            lines.append(f"  {old.name}: only before")
        elif old.suffix == ".pt":
            verdict = "same tensors" if same_weights(old, new) else "DIFFERENT"
            lines.append(f"  {old.name}: {verdict}")
        elif old.suffix == ".json":
            continue  # the manifest: its hashes follow the graphs; its fields are in the report
        else:
            lines.append(f"  {old.name}: "
                         f"{'same bytes' if old.read_bytes() == new.read_bytes() else 'DIFFERENT'}")
    return lines


REPO = Path(__file__).resolve().parent.parent


def quick_runs(folder: Path) -> tuple[Path, Path]:
    """builtin:iris trained twice by pipeline.py, into folder/before/iris and folder/after/iris."""
    for side in ("before", "after"):
        out = folder / side / "iris"
        subprocess.run([sys.executable, "pipeline.py", "--model_type", "tabular_classifier",
                        "--dataset_path", "builtin:iris", "--epochs", "3", "--plots", "none",
                        "--output_model", str(out / "model.onnx"), "--report_json",
                        str(out / "report.json")], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return folder / "before", folder / "after"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, nargs="?")
    parser.add_argument("after", type=Path, nargs="?")
    parser.add_argument("--quick", action="store_true", help="train builtin:iris twice, compare")
    args = parser.parse_args(argv)
    if args.quick:
        with tempfile.TemporaryDirectory() as tmp:
            return compare(*quick_runs(Path(tmp)))
    if args.before is None or args.after is None:
        parser.error("give BEFORE and AFTER, or --quick")
    return compare(args.before, args.after)


def compare(before: Path, after: Path) -> int:
    changed = False
    for run in sorted(p.parent for p in before.glob("*/report.json")):
        other = after / run.name
        if not (other / "report.json").exists():
            print(f"{run.name}: no run after")
            changed = True
            continue
        compared, lines = report_differences(run / "report.json", other / "report.json")
        files = bundle_differences(run, other)
        print(f"{run.name}: {compared} report values compared, {len(lines)} differ")
        print("\n".join(lines + files))
        changed |= bool(lines) or any("DIFFERENT" in line or "only" in line for line in files)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
