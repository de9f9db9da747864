"""How the parsers read a flag a user spelled their own way: the dashed spelling of a flag is the
flag (`--dataset-path` is `--dataset_path`), and a flag the script does not have is refused
naming the flags that were probably meant: the names of other tools for them (`--lr`), the
closest names (difflib) and the flags it begins (what an abbreviation would have matched)."""
from __future__ import annotations

import difflib
from typing import Collection, Sequence

# Other tools' names for a flag, and the flags they mean here: the first one a script has is
# named (keys are spelled with underscores, as a typed name is compared).
COMMON_NAMES: dict[str, tuple[str, ...]] = {
    "--lr": ("--learning_rate", "--ttt_learning_rate"),
    "--learning_rate": ("--ttt_learning_rate",),
    "--bs": ("--batch_size", "--max_batch_size"),
    "--batch": ("--batch_size", "--max_batch_size"),
    "--model": ("--output_model",),
    "--model_path": ("--model", "--output_model"),
    "--data": ("--dataset_path", "--input"),
    "--dataset": ("--dataset_path", "--input"),
    "--data_path": ("--dataset_path", "--input"),
    "--out": ("--output", "--output_model", "--html"),
    "--output": ("--output_model", "--html"),
    "--type": ("--model_type",),
    "--task": ("--model_type",),
    "--threads": ("--num_threads",),
}
SUGGESTIONS = 3  # at most this many flags in one "did you mean"


def with_underscores(argv: Sequence[str], known: Collection[str]) -> list[str]:
    """argv with each dashed flag (`--dataset-path`, `--dataset-path=x`) spelled as the known
    flag it stands for; everything after a bare `--` as it is."""
    out, args = [], list(argv)
    for index, arg in enumerate(args):
        if arg == "--":
            return out + args[index:]
        name, equals, value = arg.partition("=")
        if name.startswith("--") and name not in known:
            spelled = "--" + name[2:].replace("-", "_")
            if spelled in known:
                arg = spelled + equals + value
        out.append(arg)
    return out


def first_unknown_flag(argv: Sequence[str], known: Collection[str]) -> str | None:
    """The first argument argparse would take for a flag that the parser does not have (a
    number such as -1 or -1e-3 is a value, as is anything after a bare `--`)."""
    for arg in argv:
        if arg == "--":
            return None
        name = arg.partition("=")[0]
        if len(arg) < 2 or not arg.startswith("-") or name in known or _number(arg):
            continue
        if " " in arg and "=" not in arg:  # argparse takes "-a b" for a value
            continue
        return name
    return None


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def unknown_flag_message(flag: str, known: Collection[str]) -> str:
    """'unknown flag --lr (did you mean --learning_rate, --lr_candidates or --lr_schedule?)'."""
    guesses = suggestions(flag, known)
    if not guesses:
        return f"unknown flag {flag}"
    listed = ", ".join(guesses[:-1]) + " or " + guesses[-1] if len(guesses) > 1 else guesses[0]
    return f"unknown flag {flag} (did you mean {listed}?)"


def suggestions(flag: str, known: Collection[str]) -> list[str]:
    """The flags `flag` probably meant, best first: what other tools call it, the closest
    spellings, then the flags it begins."""
    typed = flag.lstrip("-").replace("-", "_").lower()
    flags = sorted(k for k in known if k.startswith("--") and k != "--help")
    names = {k[2:]: k for k in flags}
    common = [f for f in COMMON_NAMES.get("--" + typed, ()) if f in known][:1]
    begun = [k for k in flags if typed and k[2:].startswith(typed)]
    close = [names[n] for n in difflib.get_close_matches(typed, list(names), n=SUGGESTIONS,
                                                         cutoff=0.7)]
    return list(dict.fromkeys(common + close + begun))[:SUGGESTIONS]
