"""int8 weights for the CPU that runs them (issue 61, class Q): `--int8_range auto` quantizes with
7-bit weights (ONNX Runtime's reduce_range) where the CPU's u8 x s8 kernels saturate full-range
ones (x86 without VNNI or AMX), records the range and why in the report and the manifest, and
serving warns about a full-range int8 graph on such a CPU, where `--variant auto` keeps fp32.
Other CPUs are faked with TTC_CPUINFO (a /proc/cpuinfo text)."""
from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from onnx import numpy_helper

from conftest import assert_clean_failure, copy_bundle, edit_manifest, run_cli
from ttc.compress.int8 import choose_int8_range
from test_cpu_info import AMD_AVX2, ARM_DOT, INTEL_VNNI
from ttc.serving.runtime import cpu_info

SKYLAKE_AVX512 = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz\n"
                  "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512vl\n\n")
ALDER_LAKE = ("processor\t: 0\nmodel name\t: 12th Gen Intel(R) Core(TM) i7-12700\n"
              "flags\t\t: fpu sse2 avx avx2 fma avx_vnni\n\n")
SATURATES = "full-range (8-bit) int8 weights"
REDUCED_MAX = 64  # ONNX Runtime's reduce_range: int8 weights in [-64, 64]


def int8_weight_range(path: Path) -> tuple[int, int]:
    """The smallest and largest value of the graph's int8 initializers (its weights)."""
    values = [numpy_helper.to_array(init) for init in onnx.load(str(path)).graph.initializer
              if init.data_type == onnx.TensorProto.INT8]
    assert values, f"{path} has no int8 weights"
    return min(int(v.min()) for v in values), max(int(v.max()) for v in values)


def on_cpu(folder: Path, text: str) -> dict:
    """The environment that makes the tools read `text` as this machine's /proc/cpuinfo."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"cpuinfo_{abs(hash(text))}.txt"
    path.write_text(text)
    return {"TTC_CPUINFO": str(path)}


@pytest.mark.parametrize("text, reduced", [(AMD_AVX2, True), (SKYLAKE_AVX512, True),
                                           (ALDER_LAKE, False), (INTEL_VNNI, False),
                                           (ARM_DOT, False), ("", True)])
def test_auto_range_follows_the_cpu_s_int8_instructions(text, reduced):
    cpu = cpu_info(text)
    assert cpu.int8_saturates == (None if not text else reduced)
    auto = choose_int8_range("auto", cpu)
    assert auto.reduce_range is reduced and auto.reason.startswith("auto: ")
    assert cpu.name in auto.reason
    for asked in ("full", "reduced"):  # an explicit range is kept whatever the CPU
        chosen = choose_int8_range(asked, cpu)
        assert chosen.reduce_range is (asked == "reduced")
        assert chosen.reason == f"--int8_range {asked}"


def test_this_machine_s_pipeline_int8_records_its_range(digits_int8_bundle):
    quantize = digits_int8_bundle["report"]["quantize"]
    expected = cpu_info().int8_saturates is not False  # unknown CPUs get reduced, to be safe
    assert quantize["reduce_range"] is expected and quantize["reduce_range_reason"]
    assert quantize["cpu"]["int8_saturates"] == cpu_info().int8_saturates
    manifest = json.loads((digits_int8_bundle["dir"] / "model.json").read_text())
    assert manifest["quantization"]["reduce_range"] is expected
    low, high = int8_weight_range(digits_int8_bundle["dir"] / "model.int8.onnx")
    assert (max(-low, high) <= REDUCED_MAX) is expected


def test_static_int8_on_a_cpu_without_vnni_gets_7_bit_weights_and_says_why(digits_int8_bundle,
                                                                            tmp_path):
    model = copy_bundle(digits_int8_bundle, tmp_path / "bundle")
    run = run_cli("quantize.py", "--output_model", model, "--quantize", "static",
                  "--calibration_size", "128", "--report_json", tmp_path / "report.json",
                  extra_env=on_cpu(tmp_path, AMD_AVX2))
    assert run.returncode == 0, run.stderr[-2000:]
    quantize = json.loads((tmp_path / "report.json").read_text())["quantize"]
    assert quantize["reduce_range"] is True
    assert "AMD EPYC 7K62" in quantize["reduce_range_reason"]
    assert "no VNNI or AMX" in quantize["reduce_range_reason"]
    low, high = int8_weight_range(model.with_suffix(".int8.onnx"))
    assert low >= -REDUCED_MAX and high <= REDUCED_MAX and max(-low, high) == REDUCED_MAX
    record = json.loads(model.with_suffix(".json").read_text())["quantization"]
    assert (record["reduce_range"], record["reduce_range_reason"]) == (
        True, quantize["reduce_range_reason"])
    assert "int8 weights" in run.stdout and "7-bit (reduced range)" in run.stdout


def test_dynamic_int8_takes_the_asked_range(digits_bundle, tmp_path):
    model = copy_bundle(digits_bundle, tmp_path / "bundle")
    run = run_cli("quantize.py", "--output_model", model, "--quantize", "dynamic",
                  "--int8_range", "reduced", "--report_json", "-",
                  extra_env=on_cpu(tmp_path, INTEL_VNNI))  # VNNI: auto would keep full range
    assert run.returncode == 0, run.stderr[-2000:]
    quantize = json.loads(run.stdout)["quantize"]
    assert quantize["mode"] == "dynamic" and quantize["reduce_range"] is True
    assert quantize["reduce_range_reason"] == "--int8_range reduced"
    low, high = int8_weight_range(model.with_suffix(".int8.onnx"))
    assert low >= -REDUCED_MAX and high <= REDUCED_MAX


def test_a_bad_int8_range_is_a_usage_error(digits_bundle):
    run = run_cli("quantize.py", "--output_model", digits_bundle["model"], "--quantize",
                  "static", "--int8_range", "7bit")
    assert run.returncode == 2 and "--int8_range" in run.stderr and "Traceback" not in run.stderr


def served_graph(model: Path, env: dict, *flags: str) -> tuple[str, str]:
    """inference.py on the test split: (the graph it ran, its stderr)."""
    run = run_cli("inference.py", "--model", model, "--report_json", "-", *flags, extra_env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    return Path(json.loads(run.stdout)["inference"]["model_path"]).name, run.stderr


@pytest.fixture
def full_range_bundle(digits_int8_bundle, tmp_path) -> Path:
    """A copy of the int8 bundle whose int8 graph passed its gate, recorded as an int8 from before
    --int8_range was (no reduce_range: full range, as it then was)."""
    model = copy_bundle(digits_int8_bundle, tmp_path / "bundle")

    def as_old_full_range(manifest: dict) -> None:
        manifest["quantization"]["used_for_inference"] = True
        manifest["quantization"].pop("reduce_range", None)
        manifest["quantization"].pop("reduce_range_reason", None)
    edit_manifest(model, as_old_full_range)
    return model


def test_inference_warns_and_auto_keeps_fp32_for_full_range_int8_without_vnni(
        full_range_bundle, tmp_path):
    avx2, vnni = on_cpu(tmp_path, AMD_AVX2), on_cpu(tmp_path, INTEL_VNNI)
    graph, stderr = served_graph(full_range_bundle, avx2, "--variant", "int8")
    assert graph == "model.int8.onnx"  # asked for: run, with a warning
    assert SATURATES in stderr and "AMD EPYC 7K62" in stderr and "--int8_range reduced" in stderr
    graph, stderr = served_graph(full_range_bundle, avx2, "--variant", "auto")
    assert graph == "model.onnx" and "serving fp32 instead" in stderr
    graph, stderr = served_graph(full_range_bundle, vnni, "--variant", "auto")
    assert graph == "model.int8.onnx" and "saturate" not in stderr
    edit_manifest(full_range_bundle, lambda m: m["quantization"].update(reduce_range=True))
    graph, stderr = served_graph(full_range_bundle, avx2, "--variant", "auto")
    assert graph == "model.int8.onnx" and "saturate" not in stderr


def test_serve_warns_and_auto_serves_fp32_for_full_range_int8_without_vnni(
        full_range_bundle, tmp_path, monkeypatch):
    import test_serve

    monkeypatch.setattr(test_serve, "SERVER_ENV",
                        {**test_serve.SERVER_ENV, **on_cpu(tmp_path, AMD_AVX2)})
    with test_serve.serving(full_range_bundle, "--variant", "auto", logs=tmp_path) as server:
        assert len(server.predict([test_serve.image_row(test_serve.digit_pngs()[0])])) == 1
        info = [dict(labels) for (name, labels) in server.metrics()
                if name == "ttc_model_info"]
        log = server.log_text()
    assert [row["variant"] for row in info] == ["fp32"]
    assert "serving fp32 instead" in log and "no VNNI or AMX" in log


def test_a_manifest_with_a_malformed_range_is_refused(full_range_bundle):
    edit_manifest(full_range_bundle, lambda m: m["quantization"].update(reduce_range="yes"))
    run = run_cli("inference.py", "--model", full_range_bundle, "--variant", "int8")
    assert_clean_failure(run, 4, "quantization.reduce_range")


def test_an_accuracy_loss_of_full_range_int8_on_a_saturating_cpu_names_the_cure():
    from dataclasses import asdict

    from ttc.compress.judging import judge
    from test_cpu_info import no_faster_int8

    for text, reduce_range, named in ((AMD_AVX2, False, True), (AMD_AVX2, True, False),
                                      (INTEL_VNNI, False, False)):
        result = no_faster_int8({**asdict(cpu_info(text)), "description": "-"})
        result.reduce_range, result.accuracy, result.latency_ms_p50 = reduce_range, 0.80, 5.0
        judge(result, max_drop=0.01, force=False)
        assert not result.used_for_inference and "loses 0.150 test accuracy" in result.verdict
        assert ("--int8_range reduced" in result.verdict) is named, result.verdict
