"""An LM teacher's labels for a text student: student accuracy without and with them, one run.

    python bench/teacher_distill.py --data sms_spam.tsv [--labelled 500] [--unlabeled 3000]
        [--quick]
    python bench/teacher_distill.py --data sms_spam.tsv --teacher_lm openai/MODEL \
        --teacher_api_base http://localhost:8000/v1

Splits the SMS Spam Collection (a TSV, label<TAB>text, given with --data PATH) into a small
labelled set, texts whose labels are hidden (the teacher labels them) and a large test file,
then runs pipeline.py with --teacher_lm. Without --teacher_lm it starts a scripted stand-in on
localhost (spam = a money, prize or call-to-action word, or a 5+ digit number): a weak teacher,
not an LM, for machines without one. Prints the report's teacher section and how many of the
teacher's labels match the hidden ones. --quick: 20 labelled and 20 unlabeled texts, 1 epoch, on
a generated stand-in for the SMS texts without --data.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, add_quick_flag, sms_or_standin

sys.path.insert(0, str(REPO / "tests"))

SPAM_WORDS = re.compile(r"\b(free|win|won|winner|prize|claim|cash|urgent|txt|text|call|reply|"
                        r"mobile|offer|award|guaranteed)\b|\d{5,}", re.IGNORECASE)


def scripted_label(text: str) -> str:
    return "spam" if SPAM_WORDS.search(text) else "ham"


def split_files(data: Path, folder: Path, labelled: int, unlabeled: int, seed: int):
    rows = [r for r in data.read_text(encoding="utf-8").splitlines() if "\t" in r]
    random.Random(seed).shuffle(rows)
    parts = {"labelled": rows[:labelled], "hidden": rows[labelled:labelled + unlabeled],
             "test": rows[labelled + unlabeled:]}
    (folder / "labelled.tsv").write_text("\n".join(parts["labelled"]) + "\n", encoding="utf-8")
    (folder / "test.tsv").write_text("\n".join(parts["test"]) + "\n", encoding="utf-8")
    (folder / "unlabeled.txt").write_text(
        "\n".join(r.split("\t", 1)[1] for r in parts["hidden"]) + "\n", encoding="utf-8")
    return parts


def run_pipeline(folder: Path, args, api_base: str | None, teacher_lm: str) -> dict:
    report = folder / "report.json"
    command = [sys.executable, str(REPO / "pipeline.py"), "--model_type", "text_classifier",
               "--dataset_path", str(folder / "labelled.tsv"), "--test_path",
               str(folder / "test.tsv"), "--label_column", "0", "--text_column", "1",
               "--epochs", str(args.epochs), "--teacher_lm", teacher_lm,
               "--unlabeled_path", str(folder / "unlabeled.txt"), "--no_progress", "true",
               "--output_model", str(folder / "model.onnx"), "--report_json", str(report)]
    if api_base:
        command += ["--teacher_api_base", api_base]
    env = dict(os.environ, DSPY_CACHEDIR=str(folder / "cache"))
    env.setdefault("OPENAI_API_KEY", "local")
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"pipeline.py failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", help="the SMS Spam Collection TSV (label<TAB>text)")
    parser.add_argument("--labelled", type=int, default=500)
    parser.add_argument("--unlabeled", type=int, default=3000)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--teacher_lm")
    parser.add_argument("--teacher_api_base")
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.labelled, args.unlabeled, args.epochs = 20, 20, 1
    args.data = sms_or_standin(args.data, args.quick)
    if not args.data:
        print("skipped: pass --data PATH (the SMS Spam Collection TSV)", file=sys.stderr)
        return
    if not Path(args.data).exists():
        raise SystemExit(f"{args.data} not found: pass --data")
    with tempfile.TemporaryDirectory(prefix="bench_teacher_") as tmp:
        distill(args, Path(tmp))


def distill(args: argparse.Namespace, folder: Path) -> None:
    parts = split_files(Path(args.data), folder, args.labelled, args.unlabeled, args.seed)
    if args.teacher_lm:
        report = run_pipeline(folder, args, args.teacher_api_base, args.teacher_lm)
        teacher_name = args.teacher_lm
    else:
        from lm_server import FakeChatServer

        with FakeChatServer(scripted_label) as server:
            report = run_pipeline(folder, args, server.api_base, "openai/scripted-keywords")
        teacher_name = "scripted keyword rule (stand-in, no LM on this machine)"
    hidden = {r.split("\t", 1)[1]: r.split("\t", 1)[0] for r in parts["hidden"]}
    agree = sum(scripted_label(t) == label for t, label in hidden.items())
    section = report["teacher"]
    print(f"teacher: {teacher_name}")
    print(f"labelled {len(parts['labelled'])}, unlabeled {len(parts['hidden'])}, "
          f"test {len(parts['test'])}")
    if not args.teacher_lm:
        print(f"scripted rule vs the hidden labels: {agree / len(hidden):.4f}")
    for key in ("val_accuracy", "val_samples", "labelled", "dropped_outside_classes",
                "unparseable", "skipped_known_or_repeated", "student_train_samples",
                "student_accuracy_without_teacher", "student_accuracy_with_teacher", "seconds",
                "verdict"):
        print(f"  {key:<36} {section[key]}")


if __name__ == "__main__":
    main()
