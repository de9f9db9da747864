"""The CPU an int8 verdict was timed on: read from /proc/cpuinfo text, and named in the verdict
when int8 is not faster on a CPU without int8 dot-product instructions."""
from __future__ import annotations

from dataclasses import asdict

from ttc.compress.judging import VariantResult, cpu_section, judge
from ttc.serving.runtime import cpu_info

INTEL_VNNI = "".join(f"processor\t: {k}\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) "
                     "Platinum 8375C CPU @ 2.90GHz\nflags\t\t: fpu sse4_2 avx avx2 fma avx512f "
                     "avx512bw avx512_vnni\n\n" for k in range(4))
AMD_AVX2 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7K62 48-Core "
            "Processor\nflags\t\t: fpu sse4_2 avx avx2 fma\n\n")
ARM_DOT = ("processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd aes crc32 asimddp i8mm\n"
           "CPU implementer\t: 0x41\n\nprocessor\t: 1\nBogoMIPS\t: 243.75\n"
           "Features\t: fp asimd aes crc32 asimddp i8mm\n\n")


def test_cpuinfo_text_gives_name_cores_and_int8_instructions():
    intel = cpu_info(INTEL_VNNI)
    assert (intel.name, intel.logical_cores, intel.int8_dot_product) == (
        "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz", 4, ["AVX512-VNNI"])
    amd = cpu_info(AMD_AVX2)
    assert (amd.logical_cores, amd.int8_dot_product) == (1, [])
    assert amd.describe() == ("AMD EPYC 7K62 48-Core Processor, 1 logical core, int8 dot "
                              "product: none (no VNNI, AMX or Arm dot product)")
    arm = cpu_info(ARM_DOT)
    assert (arm.logical_cores, arm.int8_dot_product) == (2, ["Arm dot product", "Arm I8MM"])
    unknown = cpu_info("")  # no /proc/cpuinfo (macOS, Windows): the instructions are unknown
    assert unknown.int8_dot_product is None and unknown.logical_cores >= 1
    assert unknown.describe().endswith("int8 dot product: unknown")


def no_faster_int8(cpu: dict | None) -> VariantResult:
    return VariantResult(
        mode="dynamic", requested="dynamic", path="m.int8.onnx", provider="CPUExecutionProvider",
        size_bytes_fp32=400, size_bytes=100, accuracy=0.95, accuracy_fp32=0.95, top1_agreement=1.0,
        max_abs_diff=0.0, batch_size=32, latency_ms_p50=10.0, latency_ms_p50_fp32=10.1,
        latency_ms_p50_batch1=1.0, latency_ms_p50_batch1_fp32=1.0, used_for_inference=False,
        verdict="", cpu=cpu)


def test_verdict_names_a_cpu_without_int8_dot_product_only_when_int8_was_not_faster():
    without = {**asdict(cpu_info(AMD_AVX2)), "description": "AMD"}
    result = no_faster_int8(without)
    judge(result, max_drop=0.01, force=False)
    assert not result.used_for_inference
    assert ("this CPU (AMD EPYC 7K62 48-Core Processor) has no int8 dot-product instructions"
            in result.verdict) and "bench/int8_gemm.py" in result.verdict
    for cpu in ({**asdict(cpu_info(INTEL_VNNI)), "description": "Intel"}, None,
                {**asdict(cpu_info("")), "description": "unknown"}):
        result = no_faster_int8(cpu)
        judge(result, max_drop=0.01, force=False)
        assert "no faster than fp32" in result.verdict and "dot-product" not in result.verdict
    faster = no_faster_int8(without)
    faster.latency_ms_p50 = 5.0
    judge(faster, max_drop=0.01, force=False)
    assert faster.used_for_inference and "dot-product" not in faster.verdict


def test_report_section_carries_this_machine():
    section = cpu_section()
    assert section["description"] == cpu_info().describe() and section["logical_cores"] >= 1
