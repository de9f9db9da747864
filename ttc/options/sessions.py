"""The ONNX Runtime session's flags: execution providers and their options, threads,
execution mode, the memory a graph may take, profiling and the benchmark table, and the run's
wall-clock limit."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ttc.options.fields import bad, opt, parse_bool, positive

if TYPE_CHECKING:
    from ttc.serving.runtime import RuntimeOptions


@dataclass
class RuntimeFlags:
    ep: str = opt("cpu", "ONNX Runtime execution providers, highest priority first, e.g. "
                  "cuda,cpu; CPU is always the last fallback. Aliases: cpu, cuda, tensorrt, dml, "
                  "openvino, coreml, rocm", "runtime", metavar="LIST", scripts="PQIS")
    benchmark: bool = opt(False, "add a benchmark table: PyTorch eager fp32 (pipeline.py), ONNX "
                          "Runtime fp32 and int8 (when quantized), with size, accuracy, latency "
                          "at batch 1 and throughput; always on when an int8 graph exists",
                          "runtime", type=parse_bool, metavar="BOOL", scripts="PI")
    profile: bool = opt(False, "profile the graph inference runs with ONNX Runtime's profiler: "
                        "the ten most expensive operators in the report, the raw trace (Chrome "
                        "tracing JSON) beside the report as NAME.profile.json (without a report "
                        "file, beside the model); an int8 or fp16 variant no faster than fp32 "
                        "has its verdict name the op types whose time grew", "runtime",
                        type=parse_bool, metavar="BOOL", scripts="PQI")
    max_runtime_memory_mb: int = opt(4096, "the most CPU memory (MB) ONNX Runtime may take for "
                                     "a graph's tensors (weights aside): a graph with a tensor "
                                     "of fixed size beyond it is refused before running (exit "
                                     "4), an allocation beyond it at run time fails the run "
                                     "(exit 5)", "runtime", type=int, metavar="MB",
                                     scripts="PEQIS")
    strict_ep: bool = opt(False, "fail (exit 5) instead of falling back when a requested "
                          "execution provider cannot run", "runtime", type=parse_bool,
                          metavar="BOOL", scripts="PIS")
    ep_options: str | None = opt(None, "provider options as JSON or key=value list, e.g. "
                                 "cuda.device_id=0,cuda.gpu_mem_limit=2000000000 or "
                                 "tensorrt.trt_fp16_enable=true,tensorrt.trt_engine_cache_path="
                                 "trt_cache (engines then persist between runs)", "runtime",
                                 metavar="OPTIONS", scripts="PQIS")
    intra_op_threads: int | None = opt(None, "ONNX Runtime threads within an operator "
                                       "(default: --num_threads)", "runtime", type=int,
                                       metavar="N", scripts="PI")
    inter_op_threads: int = opt(1, "ONNX Runtime threads across operators (parallel execution "
                                "mode only)", "runtime", type=int, metavar="N", scripts="PI")
    execution_mode: str = opt("sequential", "ONNX Runtime execution mode", "runtime",
                              choices=("sequential", "parallel"), scripts="PI")
    num_threads: int = opt(1, "threads for PyTorch and ONNX Runtime; 0 lets each library decide "
                           "(1 is fastest for small models on busy machines)", "runtime",
                           type=int, metavar="N", scripts="PTEQIS")
    timeout_s: float = opt(0.0, "end the run after this many seconds of wall-clock time, also "
                           "inside ONNX Runtime (a graph that loops for ever): exit 124, "
                           "nothing half-written; 0: no limit", "runtime", type=float,
                           metavar="SECONDS", scripts="PTEQI")

    def check_memory(self) -> None:
        """--max_runtime_memory_mb (checked with the data stage's input bounds)."""
        positive("max_runtime_memory_mb", self.max_runtime_memory_mb)

    def check_runtime(self) -> None:
        if not 0 <= self.timeout_s < 1e9:  # also NaN; setitimer takes no more
            bad("timeout_s", self.timeout_s, "use a number of seconds, or 0 for no limit")
        if self.num_threads < 0:
            bad("num_threads", self.num_threads, "use 0 (library default) or a positive count")
        from ttc.serving.runtime import parse_ep_options, parse_providers  # numpy: not at --help

        parse_ep_options(self.ep_options, parse_providers(self.ep))
        for name in ("intra_op_threads", "inter_op_threads"):
            value = getattr(self, name)
            if value is not None and value < 0:
                bad(name, value, "use 0 (library default) or a positive count")

    def providers(self) -> list[str]:
        from ttc.serving.runtime import parse_providers

        return parse_providers(self.ep)

    def runtime(self) -> RuntimeOptions:
        """The session settings for the inference stage (--ep, --ep_options, threads)."""
        from ttc.serving.runtime import RuntimeOptions, parse_ep_options

        providers = self.providers()
        return RuntimeOptions(providers=providers,
                              provider_options=parse_ep_options(self.ep_options, providers),
                              intra_op_threads=self.num_threads if self.intra_op_threads is None
                              else self.intra_op_threads,
                              inter_op_threads=self.inter_op_threads,
                              execution_mode=self.execution_mode, strict=self.strict_ep)

    def cpu_runtime(self) -> RuntimeOptions:
        """The session settings for validation and quantization, which compare on the CPU."""
        from ttc.serving.runtime import RuntimeOptions

        return RuntimeOptions(intra_op_threads=self.runtime().intra_op_threads)

    def ray_threads(self) -> int:
        """ONNX Runtime intra-op threads per Ray worker, which are also the CPUs it reserves."""
        return max(1, self.runtime().intra_op_threads)
