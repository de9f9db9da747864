"""The image classifier: folders or tables of image files, CNNs and torchvision networks."""
from __future__ import annotations

from dataclasses import dataclass

from ttc.tasks.base import Parts, Regularisation, Task


@dataclass(frozen=True)
class ImageClassifier(Task):
    def graph_input(self, preprocessing: dict) -> dict:
        height, width = preprocessing["image_size"]
        return {"name": "image", "dtype": "float32", "layout": "NCHW", "range": [0.0, 1.0],
                "shape": ["batch", preprocessing["channels"], height, width]}

    def fixed_input_dims(self, preprocessing: dict) -> list[int | None]:
        if not isinstance(preprocessing.get("image_size"), list):
            return []
        return [preprocessing.get("channels"), *preprocessing["image_size"]]

    def report_sizes(self, preprocessing: dict) -> dict:
        return {"image_size": preprocessing["image_size"], "channels": preprocessing["channels"]}

    def factory_sizes(self, preprocessing: dict) -> dict:
        return {"channels": preprocessing["channels"],
                "image_size": list(preprocessing["image_size"])}


_TORCHVISION = ("resnet18", "resnet34", "mobilenet_v3_small", "efficientnet_b0")
TASK = ImageClassifier(
    name="image_classifier", kind="image", archs=("small_cnn", *_TORCHVISION),
    parts=Parts(reader="ttc.inputs.data:load_image_dataset", rows="ttc.serving.batch:ImageRows",
                networks="ttc.nets.models:IMAGE_NETWORKS",
                modules="ttc.nets.models:IMAGE_MODULES"),
    regularisation={"small_cnn": Regularisation(0.2, 1e-4, source="ours"),
                    **{arch: Regularisation(None, 1e-4, source="torchvision's own dropout")
                       for arch in _TORCHVISION}},
    default_tta="shift:1",
    builtins=("builtin:digits",), input_role="image", input_field="image", image_files=True,
    split_paths=False, augments=True)
