"""The image settings a rank needs to turn resized pixels into patches, from the model's
preprocessor_config.json (the frontend derives the same value from the same file)."""

from __future__ import annotations

import json
import os

from protocol.multimodal import ImageSettings, image_settings_from


def read_image_settings(model: str) -> ImageSettings:
    """The model directory's settings; transformers' defaults without the file (presets)."""
    path = os.path.join(model, "preprocessor_config.json")
    if not os.path.isfile(path):
        return ImageSettings()
    with open(path) as f:
        return image_settings_from(json.load(f))
