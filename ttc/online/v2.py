"""The Open Inference Protocol (KServe V2, which Triton speaks too) in JSON, translated to and
from the rows /predict takes: one input tensor per trained column (text and categories as BYTES,
numbers as FP32/FP64/INT, an image's file bytes as BYTES holding base64), shape [rows]; a
classifier's outputs are `label` (BYTES) and `probabilities` (FP32, [rows, classes]), and the
test-time method's extra values (FP32, [rows]); a detector's and a segmenter's are their served
parts' (boxes, scores, labels and num_detections; mask and pixels). A malformed tensor is a
ProtocolError (400 with its reason)."""
from __future__ import annotations

from typing import Any, Collection, Mapping, Sequence

import numpy as np

# each integer datatype's range, each float datatype's largest finite value
INTEGER_RANGES = {f"{sign}INT{bits}": ((0, 2 ** bits - 1) if sign else
                                       (-2 ** (bits - 1), 2 ** (bits - 1) - 1))
                  for sign in ("", "U") for bits in (8, 16, 32, 64)}
FLOAT_LIMITS = {"FP16": 65504.0, "FP32": float(np.finfo(np.float32).max),
                "FP64": float(np.finfo(np.float64).max)}
NUMBER_TYPES = set(INTEGER_RANGES) | set(FLOAT_LIMITS)  # what an FP64 input takes
NUMERIC_TYPES = NUMBER_TYPES | {"BOOL"}
DATATYPES = NUMERIC_TYPES | {"BYTES"}


class ProtocolError(ValueError):
    """A V2 request that does not follow the protocol (or this model's inputs)."""


def input_metadata(columns: Sequence[str], numeric: set[str]) -> list[dict]:
    return [{"name": name, "datatype": "FP64" if name in numeric else "BYTES", "shape": [-1]}
            for name in columns]


def output_metadata(classes: int, extra: Sequence[str]) -> list[dict]:
    return [{"name": "label", "datatype": "BYTES", "shape": [-1]},
            {"name": "probabilities", "datatype": "FP32", "shape": [-1, classes]},
            *({"name": name, "datatype": "FP32", "shape": [-1]} for name in extra)]


def request_rows(body: Any, columns: Sequence[str], numeric: Collection[str] = ()
                 ) -> list[dict]:
    """A V2 infer request's input tensors → rows of the trained columns; `numeric` the inputs
    whose metadata says FP64 (the others are BYTES), each tensor checked against its input's
    kind and its own datatype's range."""
    if not isinstance(body, Mapping) or not isinstance(body.get("inputs"), list):
        raise ProtocolError('the request has no "inputs" list of tensors')
    tensors = {}
    for tensor in body["inputs"]:
        if not isinstance(tensor, Mapping) or not isinstance(tensor.get("name"), str):
            raise ProtocolError('each input tensor needs a "name"')
        tensors[tensor["name"]] = tensor
    missing = [name for name in columns if name not in tensors]
    if missing:
        raise ProtocolError(f"the request lacks the input tensors {missing}; the model takes "
                            f"{list(columns)}")
    values = {name: tensor_values(tensors[name], name in numeric) for name in columns}
    sizes = {len(v) for v in values.values()}
    if len(sizes) != 1:
        raise ProtocolError(f"the input tensors hold different numbers of rows: "
                            f"{ {n: len(v) for n, v in values.items()} }")
    rows = sizes.pop()
    return [{name: values[name][k] for name in columns} for k in range(rows)]


def tensor_values(tensor: Mapping, numeric: bool | None = None) -> list:
    """A tensor's data as one value per row (shape [rows] or [rows, 1]), checked: its datatype
    one the input takes (`numeric`: FP64, numbers; False: BYTES; None: either) and every value
    one that datatype holds."""
    name, datatype, shape, data = (tensor.get("name"), tensor.get("datatype"),
                                   tensor.get("shape"), tensor.get("data"))
    if datatype not in DATATYPES:
        raise ProtocolError(f"input {name!r}: datatype {datatype!r} is none of "
                            f"{sorted(DATATYPES)}")
    if numeric is not None and datatype not in (NUMBER_TYPES if numeric else {"BYTES"}):
        takes = "numbers (FP64, or another FP or INT datatype)" if numeric else "BYTES (strings)"
        raise ProtocolError(f"input {name!r} takes {takes}, not {datatype}; its datatype is in "
                            "the model's metadata")
    if (not isinstance(shape, list) or not 1 <= len(shape) <= 2
            or not all(isinstance(d, int) and d >= 0 for d in shape)
            or (len(shape) == 2 and shape[1] != 1)):
        raise ProtocolError(f"input {name!r}: shape {shape!r} is not [rows] or [rows, 1]")
    if not isinstance(data, list):
        raise ProtocolError(f"input {name!r}: \"data\" must be a list")
    flat = _flattened(data)
    if len(flat) != shape[0]:
        raise ProtocolError(f"input {name!r}: {len(flat)} values for shape {shape}")
    for value in flat:
        wrong = value_outside(datatype, value)
        if wrong:
            raise ProtocolError(f"input {name!r}: {wrong}")
    return flat


def value_outside(datatype: str, value: Any) -> str | None:
    """Why `value` is no value of `datatype` (None when it is one): BYTES a string, BOOL true
    or false, an INT an integer within its range, an FP a number within its range (JSON's
    Infinity and NaN, which Python's parser reads, are left to the encoder's checks)."""
    if datatype == "BYTES":
        return None if isinstance(value, str) else "BYTES data must be strings"
    if datatype == "BOOL":
        return None if isinstance(value, bool) else "BOOL data must be true or false"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{datatype} data must be numbers"
    if datatype in INTEGER_RANGES:
        low, high = INTEGER_RANGES[datatype]
        if isinstance(value, float) and not value.is_integer():
            return f"{datatype} data must be integers, and {value!r} is not one"
        if not low <= value <= high:
            return f"{number_text(value)} is outside {datatype}'s range [{low}, {high}]"
        return None
    limit = FLOAT_LIMITS[datatype]
    if abs(value) != float("inf") and abs(value) > limit:
        return f"{number_text(value)} is outside {datatype}'s range (±{limit:.7g})"
    return None


def number_text(value: int | float) -> str:
    """A number for a message: a float as %g, an integer as its digits (their count when too
    many to show)."""
    if isinstance(value, float):
        return f"{value:g}"
    digits = str(value)
    return digits if len(digits) <= 24 else f"an integer of {len(digits.lstrip('-'))} digits"


def _flattened(data: list, levels: int = 2) -> list:
    """The values of data sent flat or nested as its shape, [rows] or [rows, 1]: at most two
    levels are unpacked (a list left inside stays one value, refused as a cell)."""
    if levels <= 1 or all(not isinstance(v, list) for v in data):
        return data
    return [w for v in data for w in (_flattened(v, levels - 1) if isinstance(v, list) else [v])]


def classifier_outputs(labels: Sequence[str], probabilities: np.ndarray,
                       extra: Mapping[str, np.ndarray]) -> list[dict]:
    """A classifier's output tensors: label, probabilities (as every prediction output rounds
    them) and the extras."""
    rows, classes = probabilities.shape
    rounded = probabilities.astype(np.float64).round(6)
    outputs = [{"name": "label", "datatype": "BYTES", "shape": [rows],
                "data": [labels[k] for k in probabilities.argmax(axis=1)]},
               {"name": "probabilities", "datatype": "FP32", "shape": [rows, classes],
                "data": rounded.ravel().tolist()}]
    outputs += [{"name": name, "datatype": "FP32", "shape": [rows],
                 "data": np.round(np.asarray(values, np.float64), 6).tolist()}
                for name, values in extra.items()]
    return outputs


def response(model_name: str, version: str, request_id: str | None, outputs: list[dict],
             wanted: Sequence[str] | None) -> dict:
    """The infer response of the model's output tensors (its type's: classifier_outputs, or a
    dense type's served part's); `wanted` the outputs the request named (None: all)."""
    if wanted is not None:
        outputs = [o for o in outputs if o["name"] in wanted]
    body = {"model_name": model_name, "model_version": version, "outputs": outputs}
    if request_id is not None:
        body["id"] = request_id
    return body


def wanted_outputs(body: Mapping, known: Sequence[str]) -> list[str] | None:
    """The outputs a request asks for by name (None: it names none, so all)."""
    asked = body.get("outputs")
    if asked is None:
        return None
    if not isinstance(asked, list) or not all(isinstance(o, Mapping) and "name" in o
                                              for o in asked):
        raise ProtocolError('"outputs" must be a list of {"name": ...}')
    names = [o["name"] for o in asked]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ProtocolError(f"unknown outputs {unknown}; the model has {list(known)}")
    return names
