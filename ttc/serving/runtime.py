"""ONNX Runtime, the way every stage runs a model: sessions on the requested execution providers
(with an honest fallback), provider options, IOBinding on GPUs, batching, and timing.

A leaf module: it imports nothing of this project but utils (errors, logging) and preprocess
(padding), so export, quantize, the test-time methods and inference all run models the same way.
No torch here.
"""
from __future__ import annotations

import os
import platform
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ttc.inputs.limits import arena_exhausted, arena_message, cap_session_memory
from ttc.inputs.preprocess import PAD_ID, PADDING_ID_KEY, text_graph_feed, trim_padding
from utils import (LOG, ConfigError, ExportError, PipelineError, RuntimeFailure, captured_stderr,
                   debug_enabled, enter_native, first_line, leave_native, on_stop,
                   raise_if_interrupted, stdout_to_stderr, stopped)

if TYPE_CHECKING:  # onnxruntime is imported where a session is made: config.py imports this
    import onnxruntime as ort

STATE_INPUT, STATE_OUTPUT = "state", "state_out"  # a recurrent graph's state in and out

# ----------------------------------------------------------------------------- providers

# Short names for ONNX Runtime execution providers; full names are accepted too.
EP_ALIASES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
    "dml": "DmlExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "rocm": "ROCMExecutionProvider",
}

# Provider options we check by name (ONNX Runtime ignores or rejects misspelt ones at run time);
# other providers' options pass through unchecked.
EP_OPTION_KEYS = {
    "CUDAExecutionProvider": ("device_id", "gpu_mem_limit", "arena_extend_strategy",
                              "cudnn_conv_algo_search", "do_copy_in_default_stream",
                              "cudnn_conv_use_max_workspace", "enable_cuda_graph"),
    "TensorrtExecutionProvider": ("device_id", "trt_fp16_enable", "trt_int8_enable",
                                  "trt_engine_cache_enable", "trt_engine_cache_path",
                                  "trt_max_workspace_size", "trt_timing_cache_enable",
                                  "trt_timing_cache_path", "trt_builder_optimization_level"),
    "CPUExecutionProvider": ("use_arena",),
}
CUDNN_SEARCH = ("EXHAUSTIVE", "HEURISTIC", "DEFAULT")

def parse_providers(text: str) -> list[str]:
    """'cuda,cpu' -> full ONNX Runtime provider names, in priority order, CPU always last."""
    names: list[str] = []
    for raw in str(text).split(","):
        item = raw.strip()
        if not item:
            continue
        full = EP_ALIASES.get(item.lower())
        if full is None and item in EP_ALIASES.values():
            full = item
        if full is None:
            valid = ", ".join(sorted(set(EP_ALIASES)))
            raise ConfigError(f"unknown execution provider {item!r} in --ep",
                              f"use one or more of: {valid} (comma-separated, highest priority first)")
        if full not in names:
            names.append(full)
    if not names:
        raise ConfigError("--ep is empty", "use e.g. --ep cpu or --ep cuda,cpu")
    if "CPUExecutionProvider" in names:
        names.remove("CPUExecutionProvider")
    return names + ["CPUExecutionProvider"]


def parse_ep_options(text: str | None, providers: Sequence[str]) -> dict[str, dict[str, str]]:
    """--ep_options as JSON ({"cuda": {"device_id": 0}} or, for the first provider, {"device_id":
    0}) or a key=value list ("cuda.device_id=0,tensorrt.trt_fp16_enable=true"; a key without a
    provider goes to the first one). Returns {full provider name: {key: string value}}."""
    import json

    if not text:
        return {}
    pairs: list[tuple[str | None, str, object]] = []
    if text.strip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--ep_options is not valid JSON ({err.msg} at column {err.colno})",
                              'e.g. --ep_options \'{"cuda": {"device_id": 0}}\'') from None
        for key, value in data.items():
            if isinstance(value, dict):
                pairs += [(key, k, v) for k, v in value.items()]
            else:
                pairs.append((None, key, value))
    else:
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"--ep_options item {item!r} is not key=value",
                                  "e.g. --ep_options cuda.device_id=0,cuda.gpu_mem_limit=2000000000")
            provider, _, name = key.strip().rpartition(".")
            pairs.append((provider or None, name, value.strip()))
    options: dict[str, dict[str, str]] = {}
    for provider, key, value in pairs:
        full = parse_providers(provider)[0] if provider else providers[0]
        if full not in providers:
            raise ConfigError(f"--ep_options names {full}, which --ep does not request",
                              "add it to --ep or drop its options")
        allowed = EP_OPTION_KEYS.get(full)
        if allowed is not None and key not in allowed:
            raise ConfigError(f"--ep_options: unknown option {key!r} for {full}",
                              f"valid: {', '.join(allowed)}")
        text_value = str(value).lower() if isinstance(value, bool) else str(value)
        if key == "cudnn_conv_algo_search" and text_value.upper() not in CUDNN_SEARCH:
            raise ConfigError(f"--ep_options: cudnn_conv_algo_search {value!r}",
                              f"use one of {', '.join(CUDNN_SEARCH)}")
        options.setdefault(full, {})[key] = text_value
    trt = options.get("TensorrtExecutionProvider", {})
    if "trt_engine_cache_path" in trt:  # a cache path means: keep engines between cron runs
        trt.setdefault("trt_engine_cache_enable", "true")
    return options


@dataclass
class RuntimeOptions:
    """How ONNX Runtime sessions are made: providers, their options, threads."""

    providers: list[str] = field(default_factory=lambda: ["CPUExecutionProvider"])
    provider_options: dict[str, dict[str, str]] = field(default_factory=dict)
    intra_op_threads: int = 1
    inter_op_threads: int = 1
    execution_mode: str = "sequential"
    strict: bool = False


# ----------------------------------------------------------------------------- sessions


# ONNX Runtime graph optimisations create_session turns off on the CPU provider
CPU_UNFUSED = ("SkipLayerNormFusion",)


def create_session(model: str | bytes, runtime: RuntimeOptions,
                   session_args: dict | None = None,
                   profile_prefix: str | None = None, classes: int | None = None,
                   source: str | Path | None = None) -> ort.InferenceSession:
    """An ORT session with all graph optimisations, on the first usable of `runtime.providers`;
    `classes`: a bundle graph's label count, which every run's outputs are checked against
    (expect_classes); `source`: the bundle file a graph given as bytes was made from.

    onnxruntime-gpu lists CUDA and TensorRT as available even without a GPU, prints red errors
    and silently runs on CPU. We capture those errors, compare the active providers with the
    request, and say in one WARNING which provider is inactive and why (exit 5 with `strict`).
    """
    import onnxruntime as ort

    strict = runtime.strict
    available = ort.get_available_providers()
    missing = [p for p in runtime.providers if p not in available]
    if missing:
        fallback(f"{', '.join(missing)} not in this onnxruntime build (it has "
                 f"{', '.join(available)})", strict)
    usable = [p for p in runtime.providers if p in available] or ["CPUExecutionProvider"]
    provider_options = with_engine_cache(runtime.provider_options, usable,
                                         bundle_folder(model, source))
    with_options = [(p, provider_options.get(p, {})) for p in usable]
    options = session_options(runtime, profile_prefix)
    # ORT's SkipLayerNormalization CPU kernel is ~4x slower than the Add + LayerNormalization it
    # replaces (hidden 128, onnxruntime 1.31: 2.6 vs 0.6 ms on 32 x 100 x 128): not fused on the
    # CPU (the CUDA kernel is another story, not measured here: GPU sessions keep the fusion)
    session_args = dict(session_args or {})
    if usable[0] == "CPUExecutionProvider":
        session_args["disabled_optimizers"] = [*session_args.get("disabled_optimizers", ()),
                                               *CPU_UNFUSED]
    session, ort_errors = open_session(model, options, with_options, session_args)
    inactive = [p for p in usable if p not in session.get_providers()]
    if inactive:
        fallback(f"{', '.join(inactive)} could not start: {provider_failure_reason(ort_errors)}; "
                 f"running on {', '.join(session.get_providers())}", strict)
    if classes is not None:
        named = source or (model if isinstance(model, str) else "the bundle's graph")
        expect_classes(session, classes, str(named))
    return session


TENSORRT = "TensorrtExecutionProvider"
ENGINE_CACHE = "tensorrt_cache"  # TensorRT's engines, in the bundle's folder


def bundle_folder(model: str | bytes, source: str | Path | None) -> Path | None:
    """The folder of the bundle file a session's graph comes from (None: a graph made in
    memory from no file)."""
    named = model if isinstance(model, str) else source
    return Path(named).parent if named else None


def with_engine_cache(options: dict[str, dict[str, str]], providers: list[str],
                      folder: Path | None) -> dict[str, dict[str, str]]:
    """TensorRT builds an engine per graph and input shape, which takes seconds to minutes:
    kept between runs (a cron job's, a server's restarts) in FOLDER/tensorrt_cache beside the
    bundle's graphs unless --ep_options names a trt_engine_cache_path. A folder that cannot be
    written (a read-only deployment) runs without the cache, with a WARNING."""
    if TENSORRT not in providers:
        return options
    trt = dict(options.get(TENSORRT, {}))
    if "trt_engine_cache_path" not in trt and folder is not None:
        trt.update(trt_engine_cache_enable="true",
                   trt_engine_cache_path=str(folder / ENGINE_CACHE))
    cache = trt.get("trt_engine_cache_path")
    if cache:
        try:
            Path(cache).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            LOG.warning("TensorRT's engine cache %s cannot be made (%s): engines are built "
                        "afresh at every start", cache, err.strerror or err)
            trt = {k: v for k, v in trt.items() if not k.startswith("trt_engine_cache")}
    return {**options, TENSORRT: trt}


def session_options(runtime: RuntimeOptions, profile_prefix: str | None
                    ) -> ort.SessionOptions:
    """All graph optimisations, `runtime`'s threads and execution mode, the capped CPU arena,
    and ONNX Runtime's profiler when `profile_prefix` is given."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = runtime.intra_op_threads
    options.inter_op_num_threads = runtime.inter_op_threads
    options.execution_mode = (ort.ExecutionMode.ORT_PARALLEL if runtime.execution_mode == "parallel"
                              else ort.ExecutionMode.ORT_SEQUENTIAL)
    options.log_severity_level = 0 if debug_enabled() else 3
    cap_session_memory(options)  # limits.py: --max_runtime_memory_mb for the graph's tensors
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return options


def open_session(model: str | bytes, options: ort.SessionOptions, providers: list,
                 session_args: dict) -> tuple[ort.InferenceSession, list[str]]:
    """The session, and the errors ONNX Runtime wrote to stderr while starting its providers
    (none kept with --log_level DEBUG, where they stay on stderr); a graph it cannot load is one
    ExportError."""
    try:
        # ORT's Python layer print()s provider errors to stdout: keep them off our stdout.
        if debug_enabled():
            with stdout_to_stderr():
                session = stoppable_session(model, options, providers=providers,
                                            **session_args)
            ort_errors: list[str] = []
        else:
            with captured_stderr() as ort_errors, stdout_to_stderr():
                session = stoppable_session(model, options, providers=providers,
                                            **session_args)
    except Exception as err:  # noqa: BLE001 - ORT raises several types for a bad model
        name = model if isinstance(model, str) else "the exported graph"
        first = first_line(err)
        raise ExportError(f"ONNX Runtime cannot load {name}: {first}",
                          "the file may be truncated or not an ONNX model; re-run export.py "
                          "or pipeline.py") from None
    return session, ort_errors


# ----------------------------------------------------------------------------- checking outputs

# The outputs whose class axis holds one value per class (the last axis, a segmenter's second):
# every bundle graph's logits and probabilities, and the passes an MC-dropout or ensemble graph
# stacks (iterative.PASSES_OUTPUT).
CLASS_OUTPUTS = ("logits", "probabilities", "pass_probabilities")
def expect_classes(session: ort.InferenceSession, classes: int, graph: str) -> None:
    """Check every run of a bundle graph's `session` against the bundle's `classes`: a graph
    declares its output shapes, and a symbolic class axis, or a declared one its nodes do not
    compute, only shows when it runs (3 classes behind 10 labels would predict wrong labels, or
    fail on an index). A mismatch, or a graph ONNX Runtime fails to run, is an ExportError
    (exit 4). The session's class (stoppable_session) does the checking."""
    session.bundle_classes = (classes, graph)


def run_failure(session: ort.InferenceSession, err: Exception) -> Exception:
    """What a failed run raises: the memory cap's refusal says so (exit 5); ONNX Runtime failing
    inside a bundle's graph (a node whose shapes do not work out) is the bundle's problem
    (exit 4); our own errors and anything else stay as they are."""
    err = memory_cap_failure(err)
    expected = getattr(session, "bundle_classes", None)
    if expected is None or isinstance(err, PipelineError):
        return err
    return ExportError(f"ONNX Runtime cannot run {expected[1]}: {first_line(err, 300)}",
                       "restore the bundle's files, or re-create the bundle with pipeline.py")


def check_classes(session: ort.InferenceSession, output: str, value: object) -> None:
    """Refuse a run's `output` whose class axis is not the bundle's (expect_classes)."""
    expected = getattr(session, "bundle_classes", None)
    shape = getattr(value, "shape", None)
    # the class axis: last, but a segmenter's planes (batch, classes, height, width) have it 2nd
    axis = 1 if shape is not None and len(shape) == 4 else -1
    if expected is None or output not in CLASS_OUTPUTS or not shape or shape[axis] == expected[0]:
        return
    classes, graph = expected
    raise ExportError(f"{graph} computes {shape[axis]} classes in its {output} output and its "
                      f"manifest has {classes} labels (the graph or the manifest was replaced)",
                      "restore the bundle's files, or re-create the bundle with pipeline.py")


# ----------------------------------------------------------------------------- stopping runs

IN_ORT = "ONNX Runtime's session.run"  # how a run stopped in there says where
_RUN_OPTIONS: ort.RunOptions | None = None  # what every run gets: a stop sets its terminate
_SESSION_CLASS: type | None = None


def stoppable_session(*args, **kwargs) -> ort.InferenceSession:
    """ort.InferenceSession(*args, **kwargs) whose runs a stop ends (SIGTERM, SIGINT,
    --timeout_s; utils.py, "stopping a run"): each gets the process's RunOptions, whose
    terminate flag the stop sets from the watcher thread (ONNX Runtime checks it before each
    node, in a Loop's body too), and counts as a native section (a graph that ignores the flag
    ends the process)."""
    global _SESSION_CLASS, _RUN_OPTIONS
    if _SESSION_CLASS is None:
        import onnxruntime as ort

        _RUN_OPTIONS = ort.RunOptions()
        _RUN_OPTIONS.log_severity_level = 0 if debug_enabled() else 4  # not the terminate error
        on_stop(_terminate_runs)
        if stopped():
            _terminate_runs()
        _SESSION_CLASS = _stoppable_session_class(ort.InferenceSession)
    return _SESSION_CLASS(*args, **kwargs)


def memory_cap_failure(err: Exception) -> Exception:
    """ONNX Runtime's arena refusing an allocation over --max_runtime_memory_mb is a run that
    needs more memory than allowed (exit 5, saying which limit); any other error is itself."""
    if not arena_exhausted(err):
        return err
    return PipelineError(arena_message(err), "raise --max_runtime_memory_mb if the machine has "
                         "the memory and you trust the bundle, or lower --batch_size")


def _terminate_runs() -> None:
    if _RUN_OPTIONS is not None:
        _RUN_OPTIONS.terminate = True


def _stoppable_session_class(base: type) -> type:
    class StoppableSession(base):  # type: ignore[misc, valid-type]
        bundle_classes: tuple[int, str] | None = None  # set by expect_classes

        def run(self, output_names, input_feed, run_options=None):
            previous = enter_native(IN_ORT)
            try:
                outputs = super().run(output_names, input_feed, run_options or _RUN_OPTIONS)
            except Exception as err:
                raise_if_interrupted()  # ORT's "terminate flag" error is the stop
                raise run_failure(self, err) from None
            finally:
                leave_native(previous)
            if self.bundle_classes is not None:
                names = output_names or [o.name for o in self.get_outputs()]
                for name, value in zip(names, outputs):
                    check_classes(self, name, value)
            return outputs

        def run_with_iobinding(self, iobinding, run_options=None):
            previous = enter_native(IN_ORT)
            try:
                return super().run_with_iobinding(iobinding, run_options or _RUN_OPTIONS)
            except Exception as err:
                raise_if_interrupted()
                raise run_failure(self, err) from None
            finally:
                leave_native(previous)

    return StoppableSession


_WARNED: set[str] = set()  # fallbacks already reported in this process (one run)


def fallback(message: str, strict: bool) -> None:
    """A requested provider cannot run: exit 5 with `strict`, else one WARNING per run (a
    pipeline run makes a session for validation, quantization, inference and each method)."""
    if strict:
        raise RuntimeFailure(f"execution provider fallback: {message}",
                             "fix the provider's drivers, or drop --strict_ep to allow fallback")
    if message not in _WARNED:
        _WARNED.add(message)
        LOG.warning("execution provider fallback: %s", message)


def provider_failure_reason(lines: Sequence[str]) -> str:
    """The most telling line of ONNX Runtime's provider errors, without colours and prefixes."""
    clean = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in lines]
    for key in ("cannot open shared object", "Failed to load", "Error", "error"):
        for line in clean:
            if key in line:
                return line.split("FAIL : ", 1)[-1].split("] ", 1)[-1][:400]
    return "its libraries or drivers are missing (no details from ONNX Runtime)"


def batches_of(x: np.ndarray, batch_size: int, pad_id: int = PAD_ID) -> list[np.ndarray]:
    """Contiguous batches; token ids lose the padding columns (of `pad_id`, the bundle's: see
    graph_padding_id) that no text in the batch needs."""
    out = [np.ascontiguousarray(x[i:i + batch_size]) for i in range(0, len(x), batch_size)]
    if x.ndim == 2 and x.dtype == np.int64:
        out = [np.ascontiguousarray(trim_padding(b, pad_id)) for b in out]
    return out


def whole_batches(batches: Sequence[np.ndarray], size: int) -> list[np.ndarray]:
    """The batches of exactly `size` rows, or all of them where none is: timed in turns with a
    last, smaller batch, a p50 per batch lands anywhere between the two sizes' times (a split of
    85 rows: batches of 64 and 21)."""
    return [b for b in batches if len(b) == size] or list(batches)


def graph_padding_id(session_or_model) -> int:
    """The padding id of a session's or ModelProto's token ids: the metadata an hf graph carries,
    else 0 (ours)."""
    if hasattr(session_or_model, "get_modelmeta"):
        metadata = session_or_model.get_modelmeta().custom_metadata_map
    else:
        metadata = {p.key: p.value for p in session_or_model.metadata_props}
    return int(metadata.get(PADDING_ID_KEY, PAD_ID))

# ----------------------------------------------------------------------------- feeding

TEXT_COMPANIONS = ("attention_mask", "token_type_ids")  # what an hf graph takes besides its ids
Feeder = Callable[[np.ndarray], dict]


def graph_feeder(input_names: Sequence[str], metadata: dict[str, str]) -> Feeder:
    """A batch of the pipeline's one input array → the graph's feed. A transformers graph
    (--arch hf:...) also takes an attention mask (and token types), derived from the ids by the
    padding id its metadata records (preprocess.text_graph_feed)."""
    names = list(input_names)
    companions = [n for n in names[1:] if n in TEXT_COMPANIONS]
    if not companions:
        return lambda batch: {names[0]: batch}
    if PADDING_ID_KEY not in metadata:
        raise ExportError(f"the graph takes {', '.join(companions)} but its metadata has no "
                          f"{PADDING_ID_KEY}", "re-export it with export.py or pipeline.py")
    text_names, pad_id = [names[0], *companions], int(metadata[PADDING_ID_KEY])
    return lambda batch: text_graph_feed(batch, text_names, pad_id)


def session_feeder(session: ort.InferenceSession) -> Feeder:
    return graph_feeder([i.name for i in session.get_inputs()],
                        session.get_modelmeta().custom_metadata_map)


def model_feeder(model) -> Feeder:
    """The feeder of an onnx.ModelProto (before a session exists: calibration)."""
    initializers = {t.name for t in model.graph.initializer}
    return graph_feeder([i.name for i in model.graph.input if i.name not in initializers],
                        {p.key: p.value for p in model.metadata_props})

# ----------------------------------------------------------------------------- running


GPU_DEVICES = {"CUDAExecutionProvider": "cuda", "TensorrtExecutionProvider": "cuda"}


def gpu_runs_first(providers: Sequence[str]) -> bool:
    """Whether a GPU provider heads --ep and this onnxruntime build has it (what --variant auto
    prefers the fp16 graph for)."""
    import onnxruntime as ort

    return bool(providers) and providers[0] in GPU_DEVICES and \
        providers[0] in ort.get_available_providers()


def session_device(session: ort.InferenceSession) -> str | None:
    """The device IOBinding should use: "cuda" when a CUDA-type provider runs the session."""
    return GPU_DEVICES.get(session.get_providers()[0])


def iobinding_runner(session: ort.InferenceSession, device: str, device_id: int = 0,
                     output: str = "probabilities") -> Callable[[np.ndarray], np.ndarray]:
    """Run through IOBinding: the input is copied to `device` once and the output is allocated
    there by ORT, instead of session.run's own copies (what matters on CUDA)."""
    import onnxruntime as ort

    feed = session_feeder(session)
    binding = session.io_binding()

    def run(batch: np.ndarray) -> np.ndarray:
        for name, value in feed(batch).items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, device,
                                                                               device_id))
        binding.bind_output(output, device, device_id)
        session.run_with_iobinding(binding)
        values = binding.copy_outputs_to_cpu()[0]
        check_classes(session, output, values)
        return values

    return run


def outputs_runner(session: ort.InferenceSession, outputs: Sequence[str]
                   ) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
    """A feed → the named outputs, through IOBinding when a GPU provider runs the session (the
    inputs copied to the GPU once, the outputs allocated there and read back once): what a
    segmenter's and a detector's runners call."""
    device = session_device(session)
    if device is None:
        return lambda feed: session.run(list(outputs), feed)
    import onnxruntime as ort

    provider = session.get_providers()[0]
    device_id = int(session.get_provider_options().get(provider, {}).get("device_id", 0))
    binding = session.io_binding()

    def run(feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        for name, value in feed.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(
                np.ascontiguousarray(value), device, device_id))
        for name in outputs:
            binding.bind_output(name, device, device_id)
        session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()

    return run


def session_runner(session: ort.InferenceSession, output: str = "probabilities",
                   state_passes: int = 1) -> Callable[[np.ndarray], np.ndarray]:
    """A batch → probabilities; through IOBinding when a GPU provider runs the session. A graph
    with a `state` input is run `state_passes` times, fed its own `state_out` (zeros first)."""
    state = state_input(session)
    feed = session_feeder(session)
    if state is not None:

        def run_with_state(batch: np.ndarray) -> np.ndarray:
            current = np.zeros((len(batch), *state), dtype=np.float32)
            for _ in range(state_passes):
                probabilities, current = session.run([output, STATE_OUTPUT],
                                                     {**feed(batch), STATE_INPUT: current})
            return probabilities

        return run_with_state
    device = session_device(session)
    if device is not None:
        provider = session.get_providers()[0]
        options = session.get_provider_options().get(provider, {})
        return iobinding_runner(session, device, int(options.get("device_id", 0)), output)
    return lambda batch: session.run([output], feed(batch))[0]


def state_input(session: ort.InferenceSession) -> list[int] | None:
    """The per-sample shape of a recurrent graph's `state` input, or None."""
    for graph_input in session.get_inputs()[1:]:
        if graph_input.name == STATE_INPUT:
            shape = graph_input.shape[1:]
            if not all(isinstance(d, int) for d in shape):
                raise ExportError(f"the state input's shape {graph_input.shape} is not fixed "
                                  "after the batch axis", "export the state with a fixed size")
            return shape
    return None


def predict_proba(session: ort.InferenceSession, x: np.ndarray, batch_size: int,
                  output: str = "probabilities") -> np.ndarray:
    run = session_runner(session, output=output)
    return np.concatenate([run(batch) for batch in batches_of(x, batch_size,
                                                               graph_padding_id(session))])

# ----------------------------------------------------------------------------- timing

WARMUP_RUNS = 3
MIN_TIMED_RUNS = 30
MIN_TIMING_SECONDS = 0.3


@dataclass
class Timings:
    """Seconds of every timed call, per runner, and the samples in each call's batch."""

    seconds: list[list[float]]
    samples: list[int]

    def percentile_ms(self, runner: int, q: float) -> float:
        return round(float(np.percentile(self.seconds[runner], q)) * 1e3, 4)

    def throughput(self, runner: int) -> float:
        return round(sum(self.samples) / float(np.sum(self.seconds[runner])), 1)


def time_runners(runners: Sequence[Callable[[np.ndarray], object]],
                 batches: Sequence[np.ndarray], runs: int | None = None,
                 warmup: int | None = None, min_seconds: float | None = None) -> Timings:
    """The one way this tool times models: the runners take turns on the same batches, so that
    machine noise hits all of them alike, after `warmup` untimed turns; at least `runs` turns
    and `min_seconds` (when several sub-millisecond variants are compared, a stable p50 needs
    many turns), at most 20 × `runs`. Unset, each is this module's constant, read at the call
    (a benchmark's smoke mode lowers them)."""
    runs = MIN_TIMED_RUNS if runs is None else runs
    warmup = WARMUP_RUNS if warmup is None else warmup
    min_seconds = MIN_TIMING_SECONDS if min_seconds is None else min_seconds
    seconds: list[list[float]] = [[] for _ in runners]
    samples: list[int] = []
    started = time.perf_counter()
    i = 0
    while i < runs + warmup or (time.perf_counter() - started < min_seconds
                                and i < 20 * runs + warmup):
        batch = batches[i % len(batches)]
        for k, run in enumerate(runners):
            start = time.perf_counter()
            run(batch)
            if i >= warmup:
                seconds[k].append(time.perf_counter() - start)
        if i >= warmup:
            samples.append(len(batch))
        i += 1
    return Timings(seconds, samples)


def best_of(repeats: int, run: Callable[[], object]) -> tuple[float, object]:
    """(shortest time of `repeats` calls, the first call's result), for whole passes over a
    split whose result does not change between calls but whose timing noise does."""
    times, first = [], None
    for k in range(repeats):
        started = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - started)
        first = result if k == 0 else first
    return min(times), first


# ----------------------------------------------------------------------------- the CPU

# Flags (Linux /proc/cpuinfo names) of the instructions that multiply and add 8-bit integers in
# one step. Without them (AVX2 alone) ONNX Runtime's int8 matrix kernels widen to 16 bits and, on
# some CPUs, run no faster than its fp32 ones: python bench/int8_gemm.py measures a machine.
INT8_DOT_FLAGS = {"avx512_vnni": "AVX512-VNNI", "avx_vnni": "AVX-VNNI", "amx_int8": "AMX-INT8",
                  "asimddp": "Arm dot product", "i8mm": "Arm I8MM"}


# x86 flags without which ONNX Runtime's u8 x s8 kernels multiply with vpmaddubsw (SSSE3, AVX2,
# AVX512-BW without VNNI): it adds each pair of u8 * s8 products into int16 with saturation, so
# full-range int8 weights (|w| up to 127: 2 * 255 * 127 > 32767) can clip. 7-bit weights
# (quantize.py --int8_range reduced: |w| <= 64) keep every pair sum in range. Arm's kernels widen
# to 16 bits without pairing, and VNNI/AMX accumulate in 32 bits: neither saturates.
X86_FLAGS = ("sse2", "avx", "avx2")
NON_SATURATING_X86 = ("avx512_vnni", "avx_vnni", "amx_int8")


@dataclass
class CpuInfo:
    """What an int8 verdict depends on: the CPU's name, its logical cores, its int8
    dot-product instructions (None: unknown, where /proc/cpuinfo cannot be read) and whether its
    u8 x s8 kernels saturate full-range int8 weights (None: unknown)."""

    name: str
    logical_cores: int
    int8_dot_product: list[str] | None
    int8_saturates: bool | None = None

    def describe(self) -> str:
        dot = ("unknown" if self.int8_dot_product is None
               else ", ".join(self.int8_dot_product) or "none (no VNNI, AMX or Arm dot product)")
        cores = f"{self.logical_cores} logical core{'s' if self.logical_cores != 1 else ''}"
        return f"{self.name}, {cores}, int8 dot product: {dot}"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or `taskset`'s share),
    which is what a local Ray cluster is given."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # macOS, Windows: no affinity masks
        return os.cpu_count() or 1


def cpu_info(cpuinfo: str | None = None) -> CpuInfo:
    """This machine's CPU from /proc/cpuinfo (or the given text of one; or the file
    $TTC_CPUINFO names: another machine's /proc/cpuinfo, to quantize and check int8 for it); the
    platform module's name, with the instructions unknown, where there is none (macOS,
    Windows)."""
    if cpuinfo is None:
        try:
            source = Path(os.environ.get("TTC_CPUINFO") or "/proc/cpuinfo")
            cpuinfo = source.read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    name = (fields.get("model name") or fields.get("hardware") or platform.processor()
            or platform.machine() or "unknown")
    flags = fields.get("flags", fields.get("features"))
    cores = len(re.findall(r"^processor\s*:\s*\d+", cpuinfo, flags=re.MULTILINE | re.IGNORECASE))
    present = None if flags is None else set(flags.split())
    return CpuInfo(name=name, logical_cores=cores or os.cpu_count() or 1,
                   int8_dot_product=None if present is None else
                   [label for flag, label in INT8_DOT_FLAGS.items() if flag in present],
                   int8_saturates=saturates(present))


def int8_saturating_cpu() -> str | None:
    """This CPU's name where full-range int8 weights can saturate here (x86 without VNNI or
    AMX), else None (also where its instructions are unknown)."""
    cpu = cpu_info()
    return cpu.name if cpu.int8_saturates else None


def saturates(flags: set[str] | None) -> bool | None:
    """Whether ONNX Runtime's u8 x s8 kernels can saturate on a CPU with these flags: an x86 CPU
    without VNNI or AMX; None where the flags are unknown."""
    if flags is None:
        return None
    return bool(flags & set(X86_FLAGS)) and not flags & set(NON_SATURATING_X86)
