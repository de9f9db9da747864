"""How long each CLI's --help takes above a bare interpreter start (issue 66: at most 0.3 s).

    python bench/cli_help.py [--rounds 15] [--quick]

Times `python X.py --help` for every CLI and `python -c pass` in turns: each round starts one
fresh interpreter of each, in a shuffled order, as a user's shell would (a warm-up round first,
not counted, so that every .pyc is written). Prints each CLI's median wall time, its excess over
the bare start (the median of the rounds' differences), the ratio (the median of the rounds'
ratios), the goal's verdict, and the modules whose own import took longest in one
`-X importtime` run (where to look next).
--quick: 2 rounds.
"""
from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, add_quick_flag

CLIS = ("pipeline.py", "train.py", "export.py", "quantize.py", "inference.py", "report.py",
        "serve.py")
BARE = "python -c pass"
GOAL_S = 0.3  # issue 66: every CLI's --help at most this far above a bare start


def command(name: str) -> list[str]:
    return [sys.executable, "-c", "pass"] if name == BARE else [sys.executable, name, "--help"]


def wall_time(name: str) -> float:
    """Seconds for one fresh interpreter to run `name` to its exit (0, or the bench stops)."""
    start = time.perf_counter()
    subprocess.run(command(name), cwd=REPO, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def rounds_of(rounds: int, seed: int = 0) -> dict[str, list[float]]:
    """{name: one wall time per round}, every name once a round in a shuffled order."""
    names = [BARE, *CLIS]
    rng = random.Random(seed)
    for name in names:  # warm-up: .pyc files written, the page cache filled
        wall_time(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            times[name].append(wall_time(name))
    return times


def costliest_imports(script: str, count: int = 3) -> str:
    """The `count` modules whose own import (without what they import) took longest in
    `python -X importtime X.py --help`, with the number imported: 'config 9 ms, ... (164)'."""
    run = subprocess.run([sys.executable, "-X", "importtime", script, "--help"], cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=True)
    found = []
    for line in run.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[0].strip().isdigit():
            found.append((int(parts[0]), parts[2].strip()))
    slowest = sorted(found, reverse=True)[:count]
    return ", ".join(f"{name} {us / 1000:.0f} ms" for us, name in slowest) + f" ({len(found)})"


def report(times: dict[str, list[float]]) -> None:
    bare = times[BARE]
    python = Path(sys.executable)
    shown = python.relative_to(REPO) if python.is_relative_to(REPO) else python
    print(f"{BARE}: median {statistics.median(bare):.3f} s over {len(bare)} rounds ({shown})")
    print(f"{'CLI --help':<14} {'median s':>9} {'excess s':>9} {'ratio':>7}  "
          "slowest own imports (modules imported)")
    excesses = {}
    for script in CLIS:
        mine = times[script]
        excesses[script] = statistics.median(t - b for t, b in zip(mine, bare))
        ratio = statistics.median(t / b for t, b in zip(mine, bare))
        print(f"{script:<14} {statistics.median(mine):>9.3f} {excesses[script]:>+9.3f} "
              f"{ratio:>6.1f}x  {costliest_imports(script)}")
    worst = max(excesses, key=excesses.get)
    verdict = "met" if excesses[worst] <= GOAL_S else "NOT met"
    print(f"goal: every CLI's --help <= {GOAL_S} s above a bare start: {verdict} "
          f"(largest: {worst} {excesses[worst]:+.3f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds of turns (default 15)")
    add_quick_flag(parser)
    args = parser.parse_args()
    report(rounds_of(2 if args.quick else args.rounds))


if __name__ == "__main__":
    main()
