"""The image classifier: folders or tables of image files, CNNs and torchvision networks."""
from __future__ import annotations

from ttc.tasks.base import Task

TASK = Task(name="image_classifier", kind="image",
            archs=("small_cnn", "resnet18", "resnet34", "mobilenet_v3_small", "efficientnet_b0"),
            builtins=("builtin:digits",), input_role="image", input_field="image", image_files=True,
            augments=True)
