"""--profile: ONNX Runtime's profiler on the graph that serves, read into the report's "profile"
section (the most expensive nodes, the time per op type) with the raw trace kept beside the
report; and, for a variant no faster than fp32, the op types whose time grew."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest

from conftest import REPO, assert_clean_failure, run_cli, write_image_folder


def ort_profiles(folder: Path) -> set[Path]:
    """The traces ONNX Runtime names itself (onnxruntime_profile_*.json) left in a folder."""
    return set(folder.glob("onnxruntime_profile_*.json")) | set(folder.glob("ort*.json"))


def assert_profile_section(section: dict, trace: Path, graph: Path) -> None:
    """Shares that sum to at most 100%, the nodes worst first, and a trace that is valid Chrome
    tracing JSON holding the nodes the section names."""
    assert section["trace"] == str(trace) and section["runs"] >= 20
    top, by_op = section["top"], section["by_op_type"]
    assert 1 <= len(top) <= 10
    assert [row["total_ms"] for row in top] == sorted((r["total_ms"] for r in top), reverse=True)
    assert all(0 < row["share"] <= 1 and row["calls"] >= 1 for row in top)
    assert sum(row["share"] for row in top) <= 1.0 + 1e-3
    assert 0.999 - 1e-3 <= sum(row["share"] for row in by_op) <= 1.0 + 1e-3
    assert section["node_ms_per_run"] <= section["ms_per_run"]  # kernels run inside the runs
    events = json.loads(trace.read_text())
    assert isinstance(events, list)
    traced = {e["name"].removesuffix("_kernel_time") for e in events if e.get("cat") == "Node"}
    assert {row["node"] for row in top} <= traced
    # every op type named is one the graph (or ONNX Runtime's fusion of it) runs
    assert {row["op_type"] for row in top} <= {e["args"].get("op_name") for e in events
                                              if e.get("cat") == "Node"}
    assert graph.exists()


def test_inference_profile_names_the_costliest_nodes_and_keeps_the_trace(digits_int8_bundle,
                                                                        tmp_path):
    model = digits_int8_bundle["model"]
    bundle_files = sorted(p.name for p in model.parent.iterdir())
    before = ort_profiles(REPO)
    run = run_cli("inference.py", "--model", model, "--profile", "true", "--no_progress", "true",
                  "--report_json", tmp_path / "inference.json")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "inference.json").read_text())
    trace = tmp_path / "inference.profile.json"
    assert_profile_section(report["profile"], trace, model)
    # the summary on stdout names the top node and where the trace is
    assert "profile:" in run.stdout and report["profile"]["top"][0]["node"][:32] in run.stdout
    assert str(trace) in run.stdout
    # ONNX Runtime's own trace files are not left behind, nor anything new in the bundle
    assert ort_profiles(REPO) == before and not ort_profiles(tmp_path)
    assert sorted(p.name for p in model.parent.iterdir()) == bundle_files
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["inference.json",
                                                               "inference.profile.json"]
    page = (tmp_path / "inference.html").read_text()
    assert "Profile (ONNX Runtime)" in page and "Most expensive nodes" in page


def test_quantize_profile_names_the_op_types_a_slower_int8_spends_its_time_in(
        digits_int8_bundle, tmp_path):
    """Dynamic int8 Conv runs as ConvInteger (with DynamicQuantizeLinear before it), several
    times slower than fp32's Conv here: the verdict names where the time went."""
    bundle = tmp_path / "b"
    shutil.copytree(digits_int8_bundle["dir"], bundle)
    run = run_cli("quantize.py", "--output_model", bundle / "model.onnx", "--quantize", "dynamic",
                  "--quantize_ops", "Conv", "--quantize_exclude", "none", "--profile", "true",
                  "--report_json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    quantize = json.loads(run.stdout)["quantize"]
    assert quantize["used_for_inference"] is False
    grown = quantize["slower_op_types"]
    assert grown and grown[0]["grew_ms"] > 0
    assert "ConvInteger" in {g["op_type"] for g in grown}
    assert all(g["ms_per_run"] - g["ms_per_run_fp32"] == pytest.approx(g["grew_ms"], abs=2e-4)
               for g in grown)
    assert "time grew in" in quantize["verdict"] and "ConvInteger" in quantize["verdict"]
    assert not ort_profiles(bundle) and not ort_profiles(REPO)


def test_profile_of_new_data_goes_beside_the_model_without_a_report_file(digits_bundle,
                                                                         tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(digits_bundle["dir"], bundle)
    folder = write_image_folder(tmp_path / "new", classes=(1, 4), per_class=8)
    run = run_cli("inference.py", "--model", bundle / "model.onnx", "--input", folder,
                  "--output", tmp_path / "preds.csv", "--batch_size", "4", "--profile", "true",
                  "--json", "true")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert report["predictions"]["predicted"] == 16
    section = report["profile"]
    assert section["batch_size"] == 4  # the --input rows, in batches of --batch_size
    assert_profile_section(section, bundle / "model.profile.json", bundle / "model.onnx")
    graph_nodes = {n.op_type for n in onnx.load(str(bundle / "model.onnx")).graph.node}
    assert "Conv" in graph_nodes


def test_profile_mistakes_are_one_line_errors(digits_bundle, tmp_path):
    folder = write_image_folder(tmp_path / "new", classes=(1,), per_class=2)
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--input", folder,
                  "--output", tmp_path / "preds.csv", "--engine", "ray", "--profile", "true")
    assert_clean_failure(run, 2, "--profile", "--engine local")
    # the trace may not overwrite an input: here the dataset file the run reads
    data = tmp_path / "report.profile.json"
    data.write_text("x\n")
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--input", data,
                  "--output", tmp_path / "preds.csv", "--profile", "true",
                  "--report_json", tmp_path / "report.json")
    assert_clean_failure(run, 2, "report.profile.json")
    assert data.read_text() == "x\n"


# ----------------------------------------------------------------------------- the trace reader

def node_event(node: str, op: str, ts: int, dur: int) -> dict:
    return {"cat": "Node", "name": f"{node}_kernel_time", "ts": ts, "dur": dur, "ph": "X",
            "args": {"op_name": op, "provider": "CPUExecutionProvider"}}


def run_event(ts: int, dur: int) -> dict:
    return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur, "ph": "X", "args": {}}


def test_the_trace_reader_skips_the_warm_up_run_and_finds_what_grew(tmp_path):
    from ttc.serving.profiling import grown_op_types, profile_section, read_trace

    def trace(name: str, conv_op: str, conv_us: int, extra: list[dict]) -> Path:
        events = [run_event(0, 5000), node_event("conv", conv_op, 10, 4000),  # warm-up
                  node_event("fc", "Gemm", 4100, 500)]
        for start in (10_000, 20_000):
            events += [run_event(start, 2000), node_event("conv", conv_op, start + 10, conv_us),
                       node_event("fc", "Gemm", start + 10 + conv_us, 200)]
            events += [dict(e, ts=e["ts"] + start) for e in extra]
        path = tmp_path / name
        path.write_text(json.dumps(events))
        return path

    fp32 = read_trace(trace("fp32.json", "Conv", 600, []), batch_size=8)
    assert fp32.runs == 2 and fp32.node_ms == {"conv": 1.2, "fc": 0.4}
    section = profile_section(fp32, None)
    assert [row["node"] for row in section["top"]] == ["conv", "fc"]
    assert section["top"][0]["share"] == 0.75 and section["top"][0]["ms_per_run"] == 0.6
    assert section["ms_per_run"] == 2.0 and section["node_ms_per_run"] == 0.8
    int8 = read_trace(trace("int8.json", "ConvInteger", 1500,
                            [node_event("q", "DynamicQuantizeLinear", 900, 100)]))
    grown = grown_op_types(fp32, int8)
    assert [g["op_type"] for g in grown] == ["ConvInteger", "DynamicQuantizeLinear"]
    assert grown[0] == {"op_type": "ConvInteger", "ms_per_run_fp32": 0.0, "ms_per_run": 1.5,
                        "grew_ms": 1.5}


def test_run_time_and_kernel_time_are_both_means_so_kernels_never_exceed_the_run(tmp_path):
    """Three runs of 1, 1 and 10 ms whose kernels fill 0.9, 0.9 and 9.9 ms: a median run
    (1 ms) beside the kernels' mean (3.9 ms) would show kernels longer than the run."""
    from ttc.serving.profiling import profile_section, read_trace

    events = [run_event(0, 5000), node_event("conv", "Conv", 10, 4000)]  # warm-up
    for start, run_us in ((10_000, 1000), (20_000, 1000), (30_000, 10_000)):
        events += [run_event(start, run_us), node_event("conv", "Conv", start + 10, run_us - 100)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(events))
    section = profile_section(read_trace(path, batch_size=4), None)
    assert section["ms_per_run"] == 4.0 and section["node_ms_per_run"] == 3.9
    assert section["node_ms_per_run"] <= section["ms_per_run"]
