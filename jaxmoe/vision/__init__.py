"""Image input: the MoonViT vision tower and projector (Kimi K2.5), and the patch layout of a batch."""

from jaxmoe.vision.layout import VisionInputs, image_grids, merged_tokens, vision_inputs
from jaxmoe.vision.tower import VisionTower

__all__ = ["VisionInputs", "VisionTower", "image_grids", "merged_tokens", "vision_inputs"]
