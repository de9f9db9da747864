"""A bundle as a DSPy tool: one step a DSPy program or agent (dspy.ReAct) can call, running ONNX
Runtime on one row. Its name, description and argument schema come from the manifest: the model
type, the classes, and the input columns (text as strings, numeric features as numbers,
categories as strings, an image as its file's bytes in base64); what it says it returns, from the
model type's served part (a classifier's label, a detector's boxes, a segmenter's mask)."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import dspy

# what the tool needs of a predictor.Predictor (not imported: predictor.py imports this module)
Predictor = Any

WHAT = {"text": "text", "feature": "row of features", "image": "image"}


def model_tool(predictor: Predictor, name: str | None = None) -> dspy.Tool:
    """predictor as a dspy.Tool: call it with the row's columns as arguments; it returns the
    row's answer, as /predict does (a classifier's {"label", "confidence", "top"} and the
    test-time method's extra values; a detector's boxes; a segmenter's mask and pixels)."""
    import dspy

    args, types = tool_arguments(predictor)

    def predict(**row: Any) -> dict:
        return predictor.predict([row])[0]

    return dspy.Tool(predict, name=name or tool_name(predictor),
                     desc=predictor.serving.tool_description(), args=args, arg_types=types)


def tool_name(predictor: Predictor) -> str:
    """A function name an LM can call: the model type, e.g. `text_classifier`."""
    return re.sub(r"\W+", "_", predictor.manifest.model_type).strip("_") or "classifier"


def classifier_description(manifest: Any, role: str) -> str:
    """A classifier's tool description (`role`: its input role, text, feature or image)."""
    what = WHAT.get(role, "input")
    classes = ", ".join(repr(label) for label in manifest.labels[:20])
    more = f" and {len(manifest.labels) - 20} more" if len(manifest.labels) > 20 else ""
    return (f"Classifies a {what} into one of {manifest.classes} classes ({classes}{more}) with "
            f"a trained {manifest.architecture.arch or manifest.architecture.name} network run "
            f"by ONNX Runtime. Returns the predicted label, its confidence (0 to 1) and the top "
            f"classes with their probabilities.")


def tool_arguments(predictor: Predictor) -> tuple[dict, dict]:
    """The JSON schema of each argument (one per input column) and its Python type."""
    numeric = set()
    encoder = predictor.reader.encoder
    if encoder is not None:
        numeric = {c["name"] for c in encoder.columns if c["type"] == "numeric"}
    args, types = {}, {}
    for column in predictor.inputs:
        if column in numeric:
            args[column] = {"type": "number", "description": f"the feature {column!r}"}
            types[column] = float
        elif predictor.reader.task.image_files:
            args[column] = {"type": "string", "description": "the image file's bytes, base64"}
            types[column] = str
        elif encoder is not None:
            args[column] = {"type": "string", "description": f"the category {column!r}"}
            types[column] = str
        else:
            single = len(predictor.inputs) == 1
            args[column] = {"type": "string", "description": "the text to classify" if single
                            else f"the text of column {column!r}"}
            types[column] = str
    return args, types
