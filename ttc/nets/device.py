"""Where a network trains and in what precision: --device and --amp resolved against what torch
sees, the autocast context and loss scaler of a training step, and batches copied to the
device (from pinned host memory, without waiting, on a GPU). Every trainer takes its device
and precision from here; none hard-codes one."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from utils import ConfigError

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cuda_count() -> int:
    """The GPUs torch can use (0 without a CUDA build, a driver or a device)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def training_device(requested: str) -> torch.device:
    """--device auto|cpu|cuda|cuda:N → the device to train on: auto is the first GPU when torch
    sees one, else the CPU. A GPU that is not there is a ConfigError (exit 2)."""
    if requested == "cpu":
        return torch.device("cpu")
    count = cuda_count()
    if requested == "auto":
        return torch.device("cuda", 0) if count else torch.device("cpu")
    index = int(requested.partition(":")[2] or 0)
    if not count:
        raise ConfigError(f"--device {requested}: torch sees no CUDA GPU on this machine "
                          f"(torch {torch.__version__}, CUDA build "
                          f"{torch.version.cuda or 'none'})",
                          "use --device auto or cpu, or install torch with CUDA where a GPU is")
    if index >= count:
        raise ConfigError(f"--device {requested}: this machine has {count} GPU(s), "
                          f"cuda:0 to cuda:{count - 1}", "name one of those")
    return torch.device("cuda", index)


@dataclass(frozen=True)
class Precision:
    """A training step's precision: `mode` off (float32), bf16 (autocast, no loss scaling) or
    fp16 (autocast with a gradient scaler), on a device of type `device_type`."""

    mode: str
    device_type: str

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.mode == "off":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=AMP_DTYPES[self.mode])

    def scaler(self) -> torch.amp.GradScaler | None:
        """fp16's loss scaler (bf16 has float32's range and needs none)."""
        return torch.amp.GradScaler(self.device_type) if self.mode == "fp16" else None


def bf16_supported(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.is_bf16_supported()


def precision_for(amp: str, device: torch.device) -> Precision:
    """--amp on `device`: auto is bf16 on a GPU that has it, fp16 on one that does not, and
    float32 on the CPU (where autocast rarely pays); bf16 and fp16 are taken as asked (on the
    CPU too), bf16 refused on a GPU without it."""
    if amp == "auto":
        mode = ("bf16" if bf16_supported(device) else "fp16") if device.type == "cuda" else "off"
    else:
        mode = amp
    if mode == "bf16" and not bf16_supported(device):
        raise ConfigError(f"--amp bf16: {torch.cuda.get_device_name(device)} has no bfloat16",
                          "use --amp fp16 (with loss scaling) or --amp off")
    return Precision(mode, device.type)


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`; to a GPU from pinned host memory without blocking the host (the
    copy overlaps the work queued before it). On the CPU: the tensor itself."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type == "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def module_device(net: nn.Module) -> torch.device:
    """The device of a network's first parameter (the CPU for one without parameters)."""
    first = next(net.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def float_outputs(outputs):
    """A network's outputs with each floating tensor in float32 (autocast's bf16/fp16 heads
    scored by a loss in full precision); the same objects when they are float32 already."""
    if isinstance(outputs, torch.Tensor):
        return outputs.float() if outputs.is_floating_point() else outputs
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(float_outputs(item) for item in outputs)
    if isinstance(outputs, dict):
        return {key: float_outputs(value) for key, value in outputs.items()}
    return outputs


def backward_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer,
                  scaler: torch.amp.GradScaler | None, clip: tuple | None = None) -> None:
    """loss.backward() and the optimizer's step, through fp16's loss scaler when there is one
    (gradients unscaled before clipping; a step with inf/NaN gradients skipped by it). `clip`:
    (parameters, max_norm) to clip the gradients' norm to."""
    if scaler is None:
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(*clip)
        optimizer.step()
        return
    scaler.scale(loss).backward()
    if clip is not None:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(*clip)
    scaler.step(optimizer)
    scaler.update()


def device_name(device: torch.device) -> str:
    """"cpu", or "cuda:0 (NVIDIA H100 80GB HBM3)": the report's train.device."""
    if device.type != "cuda":
        return device.type
    index = device.index or 0
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
