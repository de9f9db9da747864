"""DSPy beyond a wrapper: candidate search in the weight optimizer, and an LM teacher whose
labels a small ONNX student learns from. No network: a local OpenAI-compatible server for the
CLI runs, dspy.utils.DummyLM in process."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from conftest import TOPICS, assert_clean_failure, run_cli, topic_texts
from lm_server import FakeChatServer

TEXT_DATA = ["--model_type", "text_classifier", "--label_column", "0", "--text_column", "1",
             "--epochs", "3", "--no_progress", "true"]


def keyword_label(text: str) -> str:
    """A teacher that knows the topic words, except that it calls anything foggy 'maybe'."""
    words = set(text.lower().split())
    if "fog" in words:
        return "maybe"
    return next((topic for topic, vocab in TOPICS.items() if words & set(vocab)), "sports")


def write_texts(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """A labelled TSV (label, text) and an unlabeled .txt with different texts."""
    labelled = tmp_path / "labelled.tsv"
    labelled.write_text("".join(f"{label}\t{text}\n" for text, label in topic_texts(30, seed=7)))
    unlabeled_texts = [text for text, _ in topic_texts(40, seed=8)]
    unlabeled = tmp_path / "unlabeled.txt"
    unlabeled.write_text("\n".join(unlabeled_texts) + "\n")
    return labelled, unlabeled, unlabeled_texts


@pytest.fixture(autouse=True)
def teacher_env(tmp_path, monkeypatch):
    """The CLIs inherit these: DSPy's cache in the test's folder, a key the server ignores."""
    monkeypatch.setenv("DSPY_CACHEDIR", str(tmp_path / "dspy_cache"))
    monkeypatch.setenv("OPENAI_API_KEY", "test")


def test_teacher_labels_grow_the_students_data_and_are_cached(tmp_path):
    labelled, unlabeled, unlabeled_texts = write_texts(tmp_path)
    known = {line.split("\t", 1)[1] for line in labelled.read_text().splitlines()}
    new = [t for t in dict.fromkeys(unlabeled_texts) if t not in known]
    foggy = sum(keyword_label(t) == "maybe" for t in new)
    assert 0 < foggy < len(new)
    model, report_path = tmp_path / "run" / "model.onnx", tmp_path / "report.json"
    with FakeChatServer(keyword_label) as server:
        teacher = ["--teacher_lm", "openai/teacher", "--teacher_api_base", server.api_base,
                   "--unlabeled_path", unlabeled, "--teacher_demos", "2"]
        run = run_cli("pipeline.py", "--dataset_path", labelled, *TEXT_DATA, *teacher,
                      "--output_model", model, "--report_json", report_path)
        assert run.returncode == 0, run.stderr[-3000:]
        calls = server.calls
        report = json.loads(report_path.read_text())
        section = report["teacher"]
        assert section["unlabeled_texts"] == len(unlabeled_texts)
        assert section["skipped_known_or_repeated"] == len(unlabeled_texts) - len(new)
        assert section["dropped_outside_classes"] == foggy
        assert section["labelled"] == len(new) - foggy
        assert sum(section["label_counts"].values()) == section["labelled"]
        assert section["demos"] == 2 and section["val_samples"] == report["dataset"]["val"]
        # The student's training set grew by exactly the teacher's labels.
        assert report["train"]["samples"] == report["dataset"]["train"] + section["labelled"]
        assert section["student_train_samples"] == report["train"]["samples"]
        for key in ("student_accuracy_without_teacher", "student_accuracy_with_teacher"):
            assert 0 <= section[key] <= 1
        assert section["verdict"]
        # Every call was counted: probe, bootstrap, validation and the new texts at least.
        assert calls >= 1 + section["val_samples"] + len(new)
        assert run.stdout.startswith("status: ok") and "teacher:" in run.stdout
        assert "Bootstrapped" not in run.stdout  # DSPy's print went to stderr
        manifest = json.loads(model.with_suffix(".json").read_text())
        assert manifest["training"]["teacher"]["labelled"] == section["labelled"]
        # The vocabulary was refitted on the teacher's texts too.
        assert manifest["preprocessing"]["vocab_size"] > report["dataset"]["vocab_size"]
        session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        assert session.get_inputs()[0].name

        # Same flags again (train.py alone): every answer comes from DSPy's disk cache.
        again = run_cli("train.py", "--dataset_path", labelled, *TEXT_DATA, *teacher,
                        "--output_model", tmp_path / "again" / "model.onnx",
                        "--report_json", tmp_path / "again.json")
        assert again.returncode == 0, again.stderr[-3000:]
        assert server.calls == calls
    cached = json.loads((tmp_path / "again.json").read_text())["teacher"]
    assert {k: v for k, v in cached.items() if k != "seconds" and "student" not in k and k != "verdict"} == {
        k: v for k, v in section.items() if k != "seconds" and "student" not in k and k != "verdict"}


@pytest.mark.parametrize("endpoint", ["http status 500", "nothing listening"])
def test_failing_teacher_endpoint_is_one_line_exit_5(tmp_path, endpoint):
    labelled, unlabeled, _ = write_texts(tmp_path)
    with FakeChatServer(keyword_label, status=500) as server:
        api_base = server.api_base
        if endpoint == "nothing listening":
            server.__exit__()  # the port is closed again before the run
        run = run_cli("pipeline.py", "--dataset_path", labelled, *TEXT_DATA,
                      "--teacher_lm", "openai/teacher", "--teacher_api_base", api_base,
                      "--unlabeled_path", unlabeled, "--teacher_retries", "0",
                      "--output_model", tmp_path / "model.onnx",
                      timeout=120)
    assert_clean_failure(run, 5, "teacher LM openai/teacher failed", "--teacher_api_base")
    assert not (tmp_path / "model.onnx").exists()


@pytest.mark.parametrize("flags, code, phrase", [
    (["--teacher_lm", "openai/x"], 2, "--teacher_lm and --unlabeled_path go together"),
    (["--unlabeled_path", "u.txt"], 2, "--teacher_lm and --unlabeled_path go together"),
    (["--teacher_lm", "openai/x", "--unlabeled_path", "u.txt", "--model_type",
      "tabular_classifier"], 2, "labels texts"),
    (["--teacher_lm", "openai/x", "--unlabeled_path", "u.txt", "--teacher_threads", "0"], 2,
     "--teacher_threads"),
    (["--lr_candidates", "1e-3,fast"], 2, "--lr_candidates"),
    (["--num_candidates", "0"], 2, "--num_candidates"),
    (["--teacher_lm", "openai/x", "--unlabeled_path", "missing.txt"], 3, "missing.txt"),
])
def test_teacher_and_candidate_flags_are_checked(tmp_path, flags, code, phrase):
    labelled, _, _ = write_texts(tmp_path)
    args = ["--dataset_path", labelled, *TEXT_DATA, "--output_model", tmp_path / "m.onnx"]
    run = run_cli("pipeline.py", *args, *flags, timeout=120)
    assert_clean_failure(run, code, phrase)


def test_candidate_search_keeps_the_best_validation_score(tmp_path):
    report_path, model = tmp_path / "report.json", tmp_path / "model.onnx"
    run = run_cli("train.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:wine", "--epochs", "3", "--no_progress", "true",
                  "--lr_candidates", "1e-6,3e-2", "--num_candidates", "2",
                  "--output_model", model, "--report_json", report_path)
    assert run.returncode == 0, run.stderr[-3000:]
    train = json.loads(report_path.read_text())["train"]
    candidates = train["candidates"]
    assert [(c["learning_rate"], c["seed"]) for c in candidates] == [
        (1e-6, 0), (1e-6, 1), (3e-2, 0), (3e-2, 1)]
    best = max(candidates, key=lambda c: (c["val_accuracy"], -c["val_loss"]))
    assert train["chosen_candidate"] == best["index"]
    # 1e-6 barely moves the weights in 3 epochs: the search must not keep it.
    assert best["learning_rate"] == 3e-2
    assert train["val_accuracy"] == best["val_accuracy"]
    manifest = json.loads(model.with_suffix(".json").read_text())["training"]
    assert (manifest["learning_rate"], manifest["seed"]) == (3e-2, best["seed"])
    assert manifest["candidates"] == candidates
    assert "<- kept" in run.stdout


# ----------------------------------------------------------------------------- in process


def test_teacher_path_with_dummy_lm_end_to_end(tmp_path):
    """dspy.utils.DummyLM answers by text; 'maybe' and an answer without a label field are
    dropped and counted; what remains joins the training split with the teacher's labels, and
    the student trains on it (and, for the comparison, without it)."""
    from dspy.utils import DummyLM

    from config import Config
    from ttc.inputs.data import DataOptions, load_dataset
    from ttc.nets.teacher import distill
    from ttc.training.stage import train_stage

    labelled, _, _ = write_texts(tmp_path)
    config = Config(model_type="text_classifier", dataset_path=str(labelled), label_column="0",
                    text_column="1", no_progress=True, teacher_lm="dummy", teacher_demos=2,
                    teacher_threads=3)
    dataset = load_dataset(DataOptions.from_config(config))
    new = [f"item{i:03d} " + " ".join(np.random.default_rng(i).choice(
        TOPICS["food"] + TOPICS["weather"], 3)) for i in range(24)]
    answers = {t: {"label": keyword_label(t)} for t in new}
    answers[new[0]] = {"label": "Maybe"}
    answers[new[1]] = {"note": "no label field at all"}
    answers[new[2]] = {"label": " Food. "}  # case and punctuation are forgiven
    for split in dataset.splits.values():
        answers.update({t: {"label": dataset.labels[y]} for t, y in zip(split.raw, split.y)})
    unlabeled = tmp_path / "new.txt"
    unlabeled.write_text("\n".join(new) + "\n")
    config.unlabeled_path = str(unlabeled)

    result = distill(config, dataset, lm=DummyLM(answers))

    expected = {t: keyword_label(t) for t in new[3:] if keyword_label(t) != "maybe"}
    expected[new[2]] = "food"
    section = result.section
    assert section["unparseable"] == 1
    assert section["dropped_outside_classes"] == 1 + sum(keyword_label(t) == "maybe"
                                                         for t in new[3:])
    assert section["labelled"] == len(expected)
    assert section["val_accuracy"] == 1.0 and section["demos"] == 2
    train = result.dataset.train
    assert len(train) == len(dataset.train) + len(expected)
    added = dict(zip(train.raw[len(dataset.train):],
                     (result.dataset.labels[y] for y in train.y[len(dataset.train):])))
    assert added == expected
    # Every split is encoded with the refitted vocabulary.
    assert result.dataset.preprocessing["vocab_size"] > dataset.preprocessing["vocab_size"]
    assert result.dataset.test.x.max() < result.dataset.preprocessing["vocab_size"]

    config.epochs = 2
    report: dict = {}
    trained, seen = train_stage(config, dataset, report, teacher_lm=DummyLM(answers))
    assert len(seen.train) == len(dataset.train) + len(expected)
    assert report["train"]["samples"] == len(seen.train)
    assert report["teacher"]["labelled"] == len(expected)
    assert trained.preprocessing == seen.preprocessing != dataset.preprocessing
    for key in ("student_accuracy_without_teacher", "student_accuracy_with_teacher"):
        assert 0 <= report["teacher"][key] <= 1


@pytest.mark.parametrize("retries", [0, 2])
def test_teacher_calls_are_retried(retries):
    """An overloaded server (two 503s, then answers): with --teacher_retries 2 the call gets
    through on the third try; with 0 the first failure stops the run (exit 5)."""
    from config import Config
    from ttc.nets.teacher import ask_teacher, make_lm, teacher_program
    from utils import RuntimeFailure

    with FakeChatServer(keyword_label, fail_first=2) as server:
        config = Config(teacher_lm="openai/teacher", teacher_api_base=server.api_base,
                        teacher_retries=retries, teacher_cache=False)
        program, lm = teacher_program(list(TOPICS), "predict"), make_lm(config)
        if retries == 0:
            with pytest.raises(RuntimeFailure, match="503|[Ss]erver|unavailable"):
                ask_teacher(program, lm, ["rain and wind today"], list(TOPICS), 1, "", False)
            assert server.calls == 1
        else:
            answers = ask_teacher(program, lm, ["rain and wind today"], list(TOPICS), 1, "", False)
            assert answers.labels == ["weather"] and server.calls == 3


def test_chain_of_thought_teacher_reads_a_table_of_texts(tmp_path):
    """--teacher_program cot and an unlabeled CSV: the text column is found by its name."""
    from dspy.utils import DummyLM

    from ttc.nets.teacher import ask_teacher, read_unlabeled, teacher_program

    table = tmp_path / "new.csv"
    table.write_text('id,message\n1,"snow and fog, cold"\n2,bake the garlic\n3,\n')
    texts = read_unlabeled(str(table), None)
    assert texts == ["snow and fog, cold", "bake the garlic"]  # the empty text is left out
    lm = DummyLM({"snow and fog": {"reasoning": "snow is weather", "label": "weather"},
                  "garlic": {"reasoning": "garlic is food", "label": "FOOD"}})
    answers = ask_teacher(teacher_program(list(TOPICS), "cot"), lm, texts, list(TOPICS), 2,
                          "", False)
    assert answers.labels == ["weather", "food"] and answers.outside_classes == 0


def test_a_teacher_that_never_answers_in_format_stops_compiling():
    """Answers DSPy cannot parse during BootstrapFewShot: a clear RuntimeFailure after a few,
    not a pass over every training example."""
    from dspy.utils import DummyLM

    from ttc.inputs.data import Split
    from ttc.nets.teacher import MAX_BOOTSTRAP_ERRORS, compile_teacher, teacher_program
    from utils import RuntimeFailure

    texts = [f"text number {i}" for i in range(40)]
    train = Split(x=np.zeros((40, 1)), y=np.zeros(40, dtype=np.int64), ids=texts, raw=texts)
    lm = DummyLM([{"note": "no label"}] * 40)
    with pytest.raises(RuntimeFailure, match="could not parse"):
        compile_teacher(teacher_program(list(TOPICS), "predict"), lm, train, list(TOPICS), 2, 0,
                        False)
    consumed = 40 - len(list(lm.answers))  # DummyLM walks its list of answers
    assert MAX_BOOTSTRAP_ERRORS <= consumed <= 2 * MAX_BOOTSTRAP_ERRORS  # a JSON retry each
