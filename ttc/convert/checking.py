"""The numeric check of an exported graph against PyTorch: the held-out samples it runs on, the
probes (a text's lengths and padding), the comparison at several batch sizes, what non-finite
outputs mean, and the tolerance (--validate_atol) it is held to."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx

from ttc.inputs.preprocess import trim_padding
from ttc.options.export import VALIDATE_ATOL, VALIDATE_ATOL_FOR_ARCH, ExportFlags
from ttc.reporting.metrics import top1_agreement
from ttc.serving.bundle import InputSpec, Manifest, as_manifest
from ttc.serving.runtime import RuntimeOptions, create_session, session_feeder
from utils import DataError, ExportError

if TYPE_CHECKING:  # torch loads only when a graph is checked
    import torch

MIN_CHECK_SAMPLES = 32
MAX_CHECK_SAMPLES = 64
# Logits this large are a diverged model: float32 rounding alone then exceeds any sensible
# --validate_atol (a healthy classifier's logits stay within a few tens).
DIVERGED_LOGIT = 1e4
RETRAIN = "retrain with a lower --learning_rate (e.g. 1e-3)"


@dataclass
class NumericCheck:
    max_abs_diff: float
    top1_agreement: float
    samples: int
    batch_sizes: list[int]
    probes: list[str]
    padding_max_diff: float | None = None


def padding_id(input_spec: InputSpec) -> int | None:
    """The padding id of a token-id input (None for images and tables)."""
    return input_spec.pad_id if input_spec.dtype == "int64" else None


def check_samples(held_out: np.ndarray, fallback: np.ndarray, input_spec: InputSpec) -> np.ndarray:
    """32-64 real samples, held-out first; topped up from training data for tiny datasets."""
    samples = held_out[:MAX_CHECK_SAMPLES]
    pad = padding_id(input_spec)
    if len(samples) < MIN_CHECK_SAMPLES:
        samples = _concat_padded(samples, fallback[: MIN_CHECK_SAMPLES - len(samples)], pad)
    while len(samples) < MIN_CHECK_SAMPLES:
        samples = _concat_padded(samples, samples, pad)[:MIN_CHECK_SAMPLES]
    return np.ascontiguousarray(samples)


def _concat_padded(a: np.ndarray, b: np.ndarray, pad: int | None) -> np.ndarray:
    """Concatenate along the batch axis; token-id arrays of different lengths are right-padded."""
    if pad is not None and a.shape[1] != b.shape[1]:
        width = max(a.shape[1], b.shape[1])
        a, b = (np.pad(t, ((0, 0), (0, width - t.shape[1])), constant_values=pad) for t in (a, b))
    return np.concatenate([a, b])


def validation_probes(samples: np.ndarray, input_spec: InputSpec) -> dict[str, np.ndarray]:
    """Inputs to compare PyTorch and ONNX Runtime on. For text: the real lengths (texts longer
    than the tokenizer's max_length arrive truncated), every text cut to its first token (length
    1), and extra padding, up to 7 columns within max_length (it must not change a
    prediction)."""
    pad = padding_id(input_spec)
    if pad is None:
        return {"held_out": samples}
    trimmed = trim_padding(samples, pad)
    longest = input_spec.max_length if input_spec.max_length is not None else \
        trimmed.shape[1] + 7
    extra = min(7, longest - trimmed.shape[1])
    probes = {"held_out": trimmed, "length_1": np.ascontiguousarray(trimmed[:, :1])}
    if extra > 0:
        probes["padded"] = np.pad(trimmed, ((0, 0), (0, extra)), constant_values=pad)
    return probes


def compare_with_torch(model: onnx.ModelProto, net: torch.nn.Module, samples: np.ndarray,
                       input_spec: InputSpec, atol: float, batch_size: int,
                       num_threads: int, temperature: float = 1.0) -> NumericCheck:
    """Run PyTorch and ONNX Runtime on the same inputs at batch 1, an odd batch and a large one
    (the probabilities with the manifest's temperature)."""
    import torch

    from ttc.nets.models import WithProbabilities

    session = create_session(model.SerializeToString(),
                             RuntimeOptions(intra_op_threads=num_threads))
    feed = session_feeder(session)
    wrapper = WithProbabilities(net, temperature).eval()
    large = max(2, min(len(samples), batch_size))
    batch_sizes = sorted({1, 7, large})
    probes = validation_probes(samples, input_spec)
    max_diff, agreement, largest_logit = 0.0, 1.0, 0.0
    outputs: dict[str, list[np.ndarray]] = {}
    for name, probe in probes.items():
        with torch.no_grad():
            expected = [t.numpy() for t in wrapper(torch.from_numpy(probe))]
        require_finite_outputs(net, probe, expected[0], "PyTorch")
        for size in batch_sizes:
            got = [np.concatenate(parts) for parts in zip(*(
                session.run(None, feed(probe[i:i + size]))
                for i in range(0, len(probe), size)))]
            require_finite_outputs(net, probe, got[0], "ONNX Runtime")
            max_diff = max(max_diff, *(float(np.abs(g - e).max()) for g, e in zip(got, expected)))
            largest_logit = max(largest_logit, float(np.abs(got[0]).max()),
                                float(np.abs(expected[0]).max()))
            agreement = min(agreement, top1_agreement(got[0], expected[0]))
        outputs[name] = got
    padding_diff = None
    if "padded" in outputs:
        padding_diff = float(np.abs(outputs["padded"][1] - outputs["held_out"][1]).max())
        if not padding_diff <= atol:
            raise ExportError(f"padding changes predictions: max probability difference "
                              f"{padding_diff:.3g} > --validate_atol {atol:g}; the bundle was not "
                              "written", "report this: pooling must ignore padding")
    check = NumericCheck(max_diff, agreement, len(samples), batch_sizes, list(probes), padding_diff)
    if not max_diff <= atol:
        hint, raise_flags = ("raise --validate_atol if this difference is acceptable",
                             ("validate_atol",))
        if largest_logit >= DIVERGED_LOGIT:
            hint, raise_flags = (f"the model's logits reach {largest_logit:.3g}: its weights "
                                 "likely diverged in training, and no tolerance fixes that; "
                                 f"{RETRAIN}", ())
        raise ExportError(f"numeric check failed: max |onnx - torch| = {max_diff:.3g} > "
                          f"--validate_atol {atol:g} (top-1 agreement {agreement:.1%} on "
                          f"{len(samples)} held-out samples, batch sizes {batch_sizes}); "
                          "the bundle was not written", hint, raise_flags=raise_flags)
    return check


def require_finite_outputs(net: torch.nn.Module, probe: np.ndarray, logits: np.ndarray,
                           engine: str) -> None:
    """NaN or inf outputs are never a tolerance question (and NaN compares as no difference at
    all): infinite inputs are a data error (exit 3); otherwise the weights are non-finite or so
    large that they overflow, i.e. training diverged (exit 4)."""
    import torch

    bad_rows = ~np.isfinite(logits).all(axis=1)
    if not bad_rows.any():
        return
    what = "nan" if np.isnan(logits).any() else "inf"
    shown = f"{int(bad_rows.sum())} of {len(logits)} held-out samples"
    if np.issubdtype(probe.dtype, np.floating):
        bad_inputs = np.isinf(probe).reshape(len(probe), -1).any(axis=1)
        if bad_inputs.any() and not (bad_rows & ~bad_inputs).any():
            count = int(bad_inputs.sum())
            samples_hold = "1 held-out sample holds" if count == 1 else \
                f"{count} held-out samples hold"
            raise DataError(f"{samples_hold} an infinite value (inf, 1e400, or a number beyond "
                            f"float32's ±3.4e38), and the model's outputs on them are not finite "
                            f"({what}); the bundle was not written",
                            "remove those rows, or empty those cells so that they count as "
                            "missing")
    broken = [name for name, tensor in net.state_dict().items()
              if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if broken:
        cause = (f"its weights are not finite (in {', '.join(broken[:3])}): training likely "
                 "diverged")
    else:
        largest = max((float(t.abs().max()) for t in net.state_dict().values()
                       if t.is_floating_point() and t.numel()), default=0.0)
        cause = (f"its weights are likely diverged (largest |weight| {largest:.3g}) and "
                 "overflow float32")
    raise ExportError(f"the model produces non-finite outputs ({what}) in {engine} on {shown}: "
                      f"{cause}; the bundle was not written",
                      f"a tolerance cannot fix this: {RETRAIN}")


def validation_tolerance(flags: ExportFlags, manifest: Manifest | dict) -> float:
    """--validate_atol, or the default for the manifest's network (of a typed manifest, or of
    its JSON dict)."""
    if flags.validate_atol is not None:
        return flags.validate_atol
    return VALIDATE_ATOL_FOR_ARCH.get(as_manifest(manifest).architecture.arch, VALIDATE_ATOL)


def export_example(samples: np.ndarray, input_spec: InputSpec) -> np.ndarray:
    """Two real samples: with a batch (or length) of 1 the exporter would fix that axis."""
    example = samples[:2]
    pad = padding_id(input_spec)
    if pad is not None:
        example = trim_padding(example, pad)
        if example.shape[1] < 2:
            example = np.pad(example, ((0, 0), (0, 1)), constant_values=pad)
    return example


def _require_close(diff: float, what: str, flags: ExportFlags) -> None:
    """An extra graph's largest difference to the exported graph, within --validate_atol."""
    if not np.isfinite(diff):  # NaN or inf outputs: no tolerance covers them
        raise ExportError(f"the {what} gives non-finite outputs ({diff:g} difference to the "
                          "exported graph): a model's weights likely diverged in training; the "
                          "bundle was not written", f"a tolerance cannot fix this: {RETRAIN}")
    if not diff <= flags.validate_atol:
        raise ExportError(f"the {what} differs from the exported graph by {diff:.3g} > "
                          f"--validate_atol {flags.validate_atol:g}; the bundle was not written",
                          "raise --validate_atol, or report it")
