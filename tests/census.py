"""Where the suite's CLI time goes: a summary of the fork server's census.

A run of the suite with TTC_TEST_CENSUS=FILE in its environment has each test worker's fork
server (tests/forkserver.py) append one JSON line per CLI run it forked: the test that ran it
(PYTEST_CURRENT_TEST), its argv, its wall seconds, and the CPU seconds of the run and of the
processes it waited for. Ray's own processes, real interpreters the tests start and the tests'
own code are not in it: compare its totals with pytest's --durations to see their share.

    TTC_TEST_CENSUS=runs/census.jsonl .venv/bin/python -m pytest -q
    python tests/census.py runs/census.jsonl [--top 15]
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def read_census(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]


def script_of(run: dict) -> str:
    return Path(run["argv"][0]).name if run["argv"] else "?"


def file_of(run: dict) -> str:
    return (run.get("test") or "?").split("::")[0]


def totals(runs: list[dict], key) -> list[tuple[str, int, float, float]]:
    """(name, runs, CPU s, wall s) for each value of key(run), the most CPU first."""
    sums: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0])
    for run in runs:
        entry = sums[key(run)]
        entry[0] += 1
        entry[1] += run["cpu"]
        entry[2] += run["wall"]
    return sorted(((name, n, cpu, wall) for name, (n, cpu, wall) in sums.items()),
                  key=lambda row: -row[2])


def table(title: str, rows: list[tuple[str, int, float, float]], top: int) -> str:
    lines = [f"{title:<48} {'runs':>5} {'CPU s':>8} {'wall s':>8}"]
    lines += [f"{name[:48]:<48} {n:>5} {cpu:>8.1f} {wall:>8.1f}" for name, n, cpu, wall in
              rows[:top]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("census", type=Path, help="the file TTC_TEST_CENSUS named")
    parser.add_argument("--top", type=int, default=15, help="rows per table")
    args = parser.parse_args()
    runs = read_census(args.census)
    cpu, wall = sum(r["cpu"] for r in runs), sum(r["wall"] for r in runs)
    print(f"{len(runs)} CLI runs: {cpu:.1f} CPU s, {wall:.1f} wall s "
          "(a run that starts others through the fork server counts them again)")
    print(table("script", totals(runs, script_of), args.top))
    print(table("test file", totals(runs, file_of), args.top))


if __name__ == "__main__":
    main()
