"""Every bench script runs end to end with --quick (tiny data, one round, one epoch, generated
stand-ins for the SMS texts), so that a change to the code a benchmark calls cannot leave the
benchmark broken unnoticed; and none of them leaves a file in the repository.

A script whose command docs/benchmarks.md shows runs there, as documented plus --quick
(tests/test_docs_commands.py, which checks PRINTS too); the ones no page shows run here."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CLI_ENV, PAGES, REPO, fork_server, page_commands

BENCH = REPO / "bench"
SHARED_HELPERS = {"common.py"}

# script → words its printed table, ratios or goals must contain
PRINTS = {
    "device_check.py": ("samples/s", "x CPU", "goals:", "not measured", "checks: all passed"),
    "archs.py": ("arch", "params", "int8 speed-up", "bn-TTT shifted", "small_cnn"),
    "batch_scale.py": ("tabular (30 features)", "text (SMS)", "peak RSS", "raw session.run",
                       "a prediction run imports"),
    "cli_help.py": ("python -c pass: median", "pipeline.py", "serve.py", "excess s", "ratio",
                    "goal: every CLI's --help <= 0.3 s above a bare start"),
    "calibration.py": ("builtin:digits: test split", "under shift", "SMS (sms_standin.tsv)",
                       "with the tool's choice ≤ without T"),
    "calibration_slice.py": ("today (T on the validation split)", "README main job",
                             "overconfident network", "option (b), cross-fitting"),
    "compare_runs.py": ("iris: ", "report values compared, 0 differ", "model.pt: same tensors"),
    "compress.py": ("variant", "speed-up", "served", "pruned_qat",
                    "improve on post-training int8"),
    "detect.py": ("test mAP@[.5:.95]", "ONNX vs PyTorch gap", "images differing at batch",
                  "ORT fp32 / PyTorch eager at batch 1, with NMS", "bn-TTT mAP@.5 gain",
                  "int8 static 8-bit (full range)", "int8 static 7-bit (reduce_range)"),
    "detect_torchvision.py": ("ssdlite320_mobilenet_v3_large",
                              "fasterrcnn_mobilenet_v3_large_320_fpn", "s/epoch",
                              "test mAP@[.5:.95]", "goal NOT met"),
    "hf_text.py": ("tiny BERT", "(b) ORT fp32 / eager at batch 1", "goal (d)",
                   "profile of inference.py --input"),
    "int8_gemm.py": ("fp32 ms", "int8 / fp32 speed over these shapes"),
    "iterative_speed.py": ("MC-dropout (batched)", "loop/py", "calibration over 2 seeds"),
    "main_job.py": ("main job: pipeline.py", "ratio tool/twin", "CPU time", "epochs run: tool",
                    "export (export.seconds)", "before the tool's clock", "the twin's"),
    "parquet_columnar.py": ("raw session.run", "end to end, columnar", "row frames (pandas)",
                            "predictions identical: True"),
    "quantize_layers.py": ("auto exclusion", "step by step", "inference.py --profile"),
    "ray_batch.py": ("raw session.run", "end to end", "local, 1 thread", "ray, "),
    "ray_train.py": ("test accuracy", "difference ray - local", "start-up (train seconds",
                     "per epoch: local", "all-reduce share", "crossover, N = ", "A_net = 2 x P",
                     "candidate search", "ray / local wall time", "same winner",
                     "a worker's shard", "decode / fetch = "),
    "regularisation.py": ("SST-2 cnn", "own CNN 2 epochs", "plain AdamW loop", "goals",
                          "seconds after/before"),
    "regression.py": ("linear R²", "MLP(64,64) R²", "pipeline R²", "goals:",
                      "diabetes test R² vs LinearRegression", "conformal 90% coverage",
                      "friedman1 ORT fp32 / PyTorch eager at batch 1"),
    "report_cost.py": ("main job", "drawing step", "evaluation section"),
    "runtime_speed.py": ("digits CNN", "Gemm-heavy MLP", "ORT fp32 / PyTorch eager",
                         "int8 auto"),
    "segment.py": ("test mean IoU", "ORT fp32 / PyTorch eager at batch 1",
                   "in-graph TTA / loop of sessions", "bn-TTT mean IoU gain",
                   "int8 static test mean IoU"),
    "serve_load.py": ("overhead, ", "naive FastAPI, session.run per request",
                      "server CPU per request", "load generator lag",
                      "raw session.run at batch", "soak", "reloads:", "SIGTERM after", "goals"),
    "shift_score.py": ("AUROC", "clean stream", "serve.py's gauge", "goal AUROC ≥ 0.9",
                       "goal flat on a clean stream"),
    "teacher_distill.py": ("teacher: scripted keyword rule", "student_accuracy_with_teacher"),
    "text_export.py": ("max |onnx - torch|", "torch/onnx"),
    "train_augment.py": ("train_augment", "shifted accuracy", "mean"),
    "tta_speed.py": ("digits CNN", "SMS text", "breast_cancer MLP", "loop/graph"),
    "tta_policy.py": ("auto chose", "bad pool hflip,vflip,rot90", "goal auto >= -0.3 pt",
                      "goal within 0.3 pt of plain", "goals:"),
    "ttt_shift.py": ("mean of the shifts", "bn adapt+predict"),
    "ttt_stream.py": ("label_sorted stream", "shuffled stream", "never more than 1 point",
                      "keeps ≥ 90% of the unguarded gain", "vs tent.py", "agreement"),
}
RAY = {"ray_batch.py"}  # starts Ray clusters of 2 CPUs: one at a time, with tests/test_ray.py


def repository_files() -> set[Path]:
    """Every file under the repository but git's, the virtual environment's and the caches'."""
    skipped = {".git", ".venv", "__pycache__", ".pytest_cache"}
    found = set()
    for root, folders, files in os.walk(REPO):
        folders[:] = [f for f in folders if f not in skipped]
        found.update(Path(root, name).relative_to(REPO) for name in files)
    return found


def documented_scripts() -> set[str]:
    """The bench scripts whose commands the docs show (tests/test_docs_commands.py runs them)."""
    return {word.removeprefix("bench/") for page in PAGES for command in page_commands(page)
            for word in command.split() if word.startswith("bench/")}


def test_every_bench_script_has_a_smoke_test():
    scripts = {path.name for path in BENCH.glob("*.py")} - SHARED_HELPERS
    assert scripts == set(PRINTS), "a bench script without its --quick smoke test (or gone)"
    assert documented_scripts() <= scripts


@pytest.mark.parametrize("script", [
    pytest.param(name, marks=pytest.mark.xdist_group("ray")) if name in RAY else name
    for name in sorted(set(PRINTS) - documented_scripts())])
def test_bench_script_runs_quick(script, tmp_path):
    before = repository_files()
    env = dict(os.environ, **CLI_ENV)
    python = sys.executable
    server = fork_server()
    if server:  # the script and the CLIs it runs fork from the server (tests/forkserver.py)
        python = tmp_path / "python"
        server.python_shim(python, REPO)
    run = subprocess.run([str(python), str(BENCH / script), "--quick"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    for words in PRINTS[script]:
        assert words in run.stdout, (words, run.stdout[-3000:])
    assert repository_files() - before == set()
