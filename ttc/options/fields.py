"""How a flag is declared: `opt` (a dataclass field carrying what argparse and docs/cli.md
need), the help groups, the scripts' letters, the value parsers, and the two errors a check
raises. Every stage module builds its fields with these."""
from __future__ import annotations

import argparse
from dataclasses import field
from typing import Any, NoReturn, Sequence

from utils import ConfigError

GROUPS = {
    "data": "data",
    "training": "training",
    "export": "export and validation",
    "quantization": "quantization",
    "teacher": "LM teacher (text models)",
    "compression": "compression (pruning, quantization-aware training)",
    "ttc": "test-time compute",
    "batch": "batch inference (inference.py --input)",
    "distributed": "distributed training and checkpoints",
    "serve": "online serving (serve.py)",
    "runtime": "runtime",
    "output": "output",
}

_TRUE = {"true", "1", "yes", "y", "on"}
_FALSE = {"false", "0", "no", "n", "off"}


def parse_bool(text: str | bool) -> bool:
    """'true/false', '1/0', 'yes/no', 'on/off' in any case."""
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false (also 1/0, yes/no), got {text!r}")


def parse_image_size(text: str) -> tuple[int, int]:
    """'32' -> (32, 32); '24,32' or '24x32' -> (height 24, width 32)."""
    parts = [p for p in str(text).lower().replace("x", ",").split(",") if p.strip()]
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) == 1:
        numbers *= 2
    if len(numbers) != 2 or min(numbers) < 1 or max(numbers) > 4096:
        raise argparse.ArgumentTypeError(
            f"expected a size like 32 or 24,32 (height,width, 1..4096), got {text!r}")
    return numbers[0], numbers[1]



SCRIPTS = {"P": "pipeline", "T": "train", "E": "export", "Q": "quantize", "I": "inference",
           "S": "serve"}


def opt(default: Any, help: str, group: str, *, type: Any = None, choices: Sequence | None = None,
        metavar: str | None = None, scripts: str, help_for: dict[str, str] | None = None) -> Any:
    """A Config field with everything argparse needs in its metadata, and the scripts that take
    it (letters of SCRIPTS: "PTI" = pipeline.py, train.py and inference.py); `help_for` words
    the help differently for some scripts (by letter)."""
    meta = {"help": help, "group": group, "type": type, "choices": choices, "metavar": metavar,
            "scripts": tuple(SCRIPTS[letter] for letter in scripts),
            "help_for": {SCRIPTS[letter]: text for letter, text in (help_for or {}).items()}}
    return field(default=default, metadata=meta)



def positive(name: str, value: float) -> None:
    if not value > 0:
        bad(name, value, "it must be greater than 0")


def bad(name: str, value: Any, hint: str) -> NoReturn:
    raise ConfigError(f"invalid --{name} {value!r}", hint)
