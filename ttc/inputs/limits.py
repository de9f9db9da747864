"""Bounds on what a bundle or an input can make this tool allocate, checked before the memory
is taken: the length of one row of a text input, the classes a manifest may list, the image size
a bundle declares and the decoded images it implies, and the tensors an ONNX graph fixes the
size of (the rest of a graph's memory is capped inside ONNX Runtime, see cap_session_memory).

A bundle's manifest and graphs are written by whoever made the bundle: every size in them is a
claim, and a claim that would take gigabytes is refused (exit 4) instead of believed. The limits
a user may need to raise are flags (--max_row_bytes, --max_image_memory_mb,
--max_runtime_memory_mb); configure() sets them for the process. numpy only: inference's path
reads this module.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from utils import DataError, ExportError

MIB = 1 << 20
# One text row (a CSV/TSV/JSONL line, a cell, a line of stdin). A long article is 50-100 KB;
# the built-in tokenizer keeps 256 tokens of a text (about 2 KB) and Hugging Face models 512
# or so: a megabyte is 10x any real row, and tokenizing it takes about 40 MB.
DEFAULT_MAX_ROW_BYTES = MIB
# Float32 pixels of the images decoded at once for a bundle (a split held for evaluation, the
# chunks of --input in flight): the bundle's image size times the images.
DEFAULT_MAX_IMAGE_MEMORY_MB = 4096
# ONNX Runtime's CPU memory for a graph's tensors (its arena), and the most one tensor whose
# size the graph fixes may take.
DEFAULT_MAX_RUNTIME_MEMORY_MB = 4096
MAX_IMAGE_SIDE = 4096  # pixels, as --image_size allows
MAX_LABELS = 100_000  # ImageNet-21k has 21,841 classes
# Token ids per text, as --max_length allows (ours default to 256, Hugging Face models take 512
# to 32k): a chunk of texts is padded to its longest, 4,096 rows x 32,768 ids = 1 GB at most.
MAX_TEXT_LENGTH = 32768
SCAN_BLOCK = 4 * MIB  # bytes read at a time when a file's line lengths are checked


@dataclass
class Limits:
    """This process's limits (configure() sets them from the flags)."""

    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES
    max_image_memory_mb: int = DEFAULT_MAX_IMAGE_MEMORY_MB
    max_runtime_memory_mb: int = DEFAULT_MAX_RUNTIME_MEMORY_MB


LIMITS = Limits()


def configure(flags: Any) -> None:
    """Take the limits from the parsed flags, a Config or a stage's options (flags a script
    does not have keep their defaults)."""
    for name in vars(LIMITS):
        value = getattr(flags, name, None)
        if value is not None:
            setattr(LIMITS, name, int(value))


def use_limits(limits: Limits | None) -> None:
    """Take another process's limits (a Ray worker takes the driver's)."""
    if limits is not None:
        configure(limits)


def size_text(count: float) -> str:
    """Bytes as people read them: 6.7 GB, 25.0 MB, 1.0 MB (decimal units)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{int(count)} bytes"


# ----------------------------------------------------------------------------- text rows


def long_line(path: Path, limit: int) -> tuple[int, int, bool] | None:
    """The first line of a file longer than `limit` bytes, as (1-based line number, its bytes,
    whether that is all of it or what was read of it before giving up), or None. Reads
    SCAN_BLOCK bytes at a time and stops as soon as a line passes the limit: memory stays at a
    block whatever the file holds."""
    line, start, offset = 1, 0, 0
    with open(path, "rb") as handle:
        while block := handle.read(SCAN_BLOCK):
            ends = np.flatnonzero(np.frombuffer(block, np.uint8) == 10) + offset
            bounds = np.concatenate(([start], ends + 1))
            lengths = np.diff(bounds) - 1 if len(ends) else np.empty(0, np.int64)
            over = np.flatnonzero(lengths > limit)
            if len(over):
                return line + int(over[0]), int(lengths[over[0]]), True
            line += len(ends)
            start = int(bounds[-1])
            offset += len(block)
            if offset - start > limit:
                return line, offset - start, False
    return None


def check_line_lengths(path: Path, limit: int | None = None) -> None:
    """Refuse (exit 3) a text file with a line longer than --max_row_bytes before any parser
    holds it: pandas and the tokenizer would take some 10-40 times its size."""
    limit = limit or LIMITS.max_row_bytes
    found = long_line(path, limit)
    if found:
        line, length, whole = found
        raise DataError(f"{path} line {line} is longer than --max_row_bytes {limit} bytes "
                        f"({'' if whole else 'at least '}{length:,} bytes); one row "
                        "of text is never that long", row_hint(limit))


def row_hint(limit: int) -> str:
    return (f"split or shorten that row, or raise --max_row_bytes (now {limit}) if rows that "
            "long are real")


def check_text_lengths(texts: Any, limit: int | None = None) -> None:
    """Refuse (exit 3) texts (a pandas Series, indexed by data row) of which one is longer than
    --max_row_bytes characters before they are tokenized: a quoted CSV cell over many short
    lines, or a JSON or Parquet string, passes the line check."""
    limit = limit or LIMITS.max_row_bytes
    longest = max(map(len, texts), default=0)
    if longest > limit:
        row = texts.index[int(np.argmax([len(t) for t in texts]))]
        where = f"row {int(row) + 1}" if isinstance(row, (int, np.integer)) else f"row {row}"
        raise DataError(f"the text of {where} has {longest:,} characters, over --max_row_bytes "
                        f"{limit}; one row of text is never that long", row_hint(limit))


# ----------------------------------------------------------------------------- images


def image_bytes(preprocessing: dict) -> int:
    """Float32 bytes of one decoded image of an image preprocessing."""
    height, width = preprocessing["image_size"]
    return int(height) * int(width) * int(preprocessing["channels"]) * 4


def check_decoded_images(preprocessing: dict, count: int, what: str) -> None:
    """Refuse (exit 4) decoding `count` images at a bundle's image size when they would take more
    than --max_image_memory_mb: the size is the bundle's word, the images are the user's."""
    need = count * image_bytes(preprocessing)
    limit = LIMITS.max_image_memory_mb * MIB
    if need > limit:
        height, width = preprocessing["image_size"]
        channels = preprocessing["channels"]
        raise ExportError(
            f"the bundle's image size {height}x{width} ({channels} channel"
            f"{'s' if channels > 1 else ''}, "
            f"{size_text(image_bytes(preprocessing))} per decoded image) makes the {count} "
            f"images of {what} take {size_text(need)}, over --max_image_memory_mb "
            f"{LIMITS.max_image_memory_mb}",
            "a bundle this tool trained holds the size it trained at; raise "
            "--max_image_memory_mb only for a bundle you trust")


def images_per_chunk(preprocessing: dict, rows: int, unit: int = 1, copies: int = 4) -> int:
    """How many images of --input a chunk may hold: `rows` at most, and `copies` chunks in
    flight (decoded, stacked, prefetched) within --max_image_memory_mb; a multiple of `unit`
    (test-time training's batch) where `rows` is one."""
    fit = LIMITS.max_image_memory_mb * MIB // (copies * image_bytes(preprocessing))
    if fit >= rows:
        return rows
    return max(unit, fit // unit * unit) if rows % unit == 0 else max(1, fit)


# ----------------------------------------------------------------------------- weights


def inflating_archive_problem(path: Path) -> str | None:
    """Why a torch file (a ZIP, as torch.save writes it) must not be loaded: entries compressed
    (torch.save stores them as they are), which torch.load would inflate whole, a few MB to
    gigabytes; or entries declaring more bytes than the file holds (entries overlapping, or
    sizes that lie), which torch would allocate before reading. None for a plain archive or a
    file that is no ZIP (torch.load says what it is)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return None
    declared = sum(entry.file_size for entry in entries)
    packed = sum(entry.compress_type != zipfile.ZIP_STORED for entry in entries)
    if packed:
        return (f"{packed} of its {len(entries)} entries are compressed, inflating to "
                f"{size_text(declared)}, and torch.save writes none compressed")
    held = path.stat().st_size
    if declared > held:
        return (f"its {len(entries)} entries declare {size_text(declared)}, more than the "
                f"{size_text(held)} the file holds (entries that overlap or misstate their "
                "sizes), which torch.save never writes")
    return None


# ----------------------------------------------------------------------------- graphs

_ELEMENT_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8,
                  14: 8, 15: 16, 16: 2, 17: 1, 18: 1, 19: 1, 20: 1, 21: 1, 22: 1, 23: 1}
INLINE_INITIALIZER_BYTES = 4096  # initializers this small keep their values for shape inference


def graph_size_problem(model: Any, limit_bytes: int | None = None) -> str | None:
    """The first tensor of an ONNX graph whose size the graph itself fixes, for one sample
    (symbolic dimensions such as the batch count as 1), beyond the runtime memory limit or the
    graph's largest stored weight, whichever is larger; None when there is none. Shapes come
    from ONNX shape inference with constant propagation, so ConstantOfShape, Expand, Tile,
    Range, Resize, Reshape or Pad with constant shape inputs are all seen."""
    limit = max(limit_bytes or LIMITS.max_runtime_memory_mb * MIB,
                max((_stored_bytes(t) for t in model.graph.initializer), default=0))
    inferred = _inferred(model)
    producers = {out: node for node in _all_nodes(inferred.graph) for out in node.output}
    for value in _all_values(inferred.graph):
        size = _value_bytes(value)
        if size is not None and size > limit:
            node = producers.get(value.name)
            made = f" made by a {node.op_type} node" if node is not None else ""
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                    for d in value.type.tensor_type.shape.dim]
            return (f"its tensor {value.name[:60]!r}{made} of shape {dims[:8]} takes "
                    f"{size_text(size)} per sample, over --max_runtime_memory_mb "
                    f"{limit // MIB}")
    return None


def _inferred(model: Any) -> Any:
    """The model with shapes inferred, on a light copy whose big initializers are graph inputs
    (shape inference needs their shapes, not their values); the model itself when inference
    fails (then ONNX Runtime's memory cap is what bounds it)."""
    import onnx
    from onnx import helper, shape_inference

    light = onnx.ModelProto()
    light.ir_version, light.producer_name = model.ir_version, model.producer_name
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    graph = light.graph
    graph.node.extend(model.graph.node)
    graph.input.extend(model.graph.input)
    graph.output.extend(model.graph.output)
    inputs = {i.name for i in model.graph.input}
    for tensor in model.graph.initializer:
        if _stored_bytes(tensor) <= INLINE_INITIALIZER_BYTES and \
                tensor.data_location != onnx.TensorProto.EXTERNAL:
            graph.initializer.append(tensor)
        elif tensor.name not in inputs:
            graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type,
                                                             list(tensor.dims)))
    try:
        return shape_inference.infer_shapes(light, check_type=False, strict_mode=False,
                                            data_prop=True)
    except Exception:  # noqa: BLE001 - an invalid graph: ONNX Runtime reports it when loading
        return light


def _stored_bytes(tensor: Any) -> int:
    return int(np.prod(tensor.dims, dtype=np.float64)) * _ELEMENT_BYTES.get(tensor.data_type, 8)


def _value_bytes(value: Any) -> int | None:
    """Bytes of a value's tensor type with symbolic dimensions as 1, or None when unknown."""
    kind = value.type.tensor_type
    if not value.type.HasField("tensor_type") or not kind.HasField("shape"):
        return None
    count = 1.0
    for dim in kind.shape.dim:
        if dim.HasField("dim_value"):
            count *= max(dim.dim_value, 0)
    return int(min(count * _ELEMENT_BYTES.get(kind.elem_type, 8), 2.0 ** 62))


def _all_nodes(graph: Any) -> Iterator[Any]:
    for node in graph.node:
        yield node
        for sub in _subgraphs(node):
            yield from _all_nodes(sub)


def _all_values(graph: Any) -> Iterator[Any]:
    yield from graph.value_info
    yield from graph.output
    for node in graph.node:
        for sub in _subgraphs(node):
            yield from _all_values(sub)


def _subgraphs(node: Any) -> list:
    return [g for a in node.attribute for g in ([a.g] if a.HasField("g") else []) + list(a.graphs)]


# ----------------------------------------------------------------------------- ONNX Runtime

_ARENA: list[int] = []  # the CPU arena's limit, once registered (one per process)


def cap_session_memory(options: Any) -> None:
    """Make a session allocate its CPU tensors from one process-wide ONNX Runtime arena limited
    to --max_runtime_memory_mb (weights stay outside it): a graph that asks for more at run
    time, with sizes no check could see before, fails that run instead of taking the machine."""
    import onnxruntime as ort

    if not _ARENA:
        limit = LIMITS.max_runtime_memory_mb * MIB
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                 ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(limit, -1, -1, -1))
        _ARENA.append(limit)
    options.add_session_config_entry("session.use_env_allocators", "1")
    options.add_session_config_entry("session.use_device_allocator_for_initializers", "1")


def arena_exhausted(err: BaseException) -> bool:
    """Whether an ONNX Runtime error is an allocation refused: by the arena's limit, or by the
    machine (out of memory)."""
    text = str(err)
    return "BFCArena" in text and ("Available memory of" in text or
                                   "Failed to allocate memory" in text)


def arena_message(err: BaseException) -> str:
    """The error line (what, then how to fix) for an allocation ONNX Runtime refused."""
    import re

    text = str(err)
    asked = re.search(r"requested (?:bytes of|buffer of size) (\d+)", text)
    node = re.search(r"while running (\w+) node", text)
    what = f" of {size_text(int(asked.group(1)))}" if asked else ""
    where = f" in a {node.group(1)} node" if node else ""
    if "Available memory of" not in text:
        return (f"ONNX Runtime ran out of memory (an allocation{what}{where}); lower "
                "--batch_size or --max_runtime_memory_mb")
    return (f"ONNX Runtime needed more memory than --max_runtime_memory_mb "
            f"{LIMITS.max_runtime_memory_mb} allows (an allocation{what}{where}); lower "
            "--batch_size, or raise --max_runtime_memory_mb for a bundle you trust")
