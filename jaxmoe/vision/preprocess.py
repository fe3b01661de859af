"""Images to the vision tower's patches, the way the Kimi K2.5 image processor makes them (Pillow + numpy).

Pillow decodes the bytes (PNG, JPEG, WebP, GIF's first frame, BMP) and converts them to RGB,
compositing any transparency onto white. numpy does the rest, exactly as the reference processor:

1. **Size** (``patch_grid``): shrink, never enlarge, so that the image holds at most
   ``max_patches`` patches in all and ``max_patches_per_side`` along each side; then pad the
   bottom and right with black up to a multiple of ``merge x patch`` pixels.
2. **Resize**: antialiased bicubic (Keys a = -0.5, the filter's support widened by the shrink
   factor, half-pixel centres), as torchvision resizes a uint8 tensor: in float, then rounded
   and clamped back to uint8. Two separable passes, each a matrix product.
3. **Normalise** to ``(x / 255 - mean) / std`` (0.5 and 0.5 per channel), float32.
4. **Patchify**: patches in raster order over the grid, each ``[3, patch, patch]``.

``limits`` refuse what a server must not decode: too many images, too many bytes, too many
pixels before resizing (decompression bombs), unsupported formats; each raises
:class:`ImageError` naming the image and the limit.
"""

from __future__ import annotations

import dataclasses
import io
import math
import warnings

import numpy as np
from PIL import Image

from jaxmoe.config import VisionConfig

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)


class ImageError(ValueError):
    """An image that cannot be used, with what is wrong and what is allowed."""


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be; the resizing caps are the reference processor's defaults.

    Attributes:
      max_images: images in one request (or one ``generate`` call).
      max_bytes: encoded bytes of one image.
      max_pixels: width x height of one decoded image before resizing.
      max_patches: patches of one image after resizing (it is shrunk to fit).
      max_patches_per_side: patches along either side after resizing.
    """

    max_images: int = 8
    max_bytes: int = 20 * 2**20
    max_pixels: int = 64 * 2**20
    max_patches: int = 16384
    max_patches_per_side: int = 512

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"image limits: {field.name} must be a positive integer, got {value!r}")


def decode(data: bytes, limits: ImageLimits = ImageLimits(), *, name: str = "image") -> np.ndarray:
    """``[H, W, 3]`` uint8 RGB of one encoded image, checked against ``limits``.

    Raises:
      ImageError: too many bytes or pixels, not an image, or a format outside :data:`FORMATS`.
    """
    if len(data) > limits.max_bytes:
        raise ImageError(f"{name}: {len(data)} bytes is over the limit of {limits.max_bytes} bytes per image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size
            if width * height > limits.max_pixels:
                raise ImageError(
                    f"{name}: {width} x {height} pixels is over the limit of {limits.max_pixels} pixels per image"
                )
            image.load()
    except ImageError:
        raise
    except (Image.UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"{name}: not a readable image (allowed formats: {', '.join(FORMATS)}): {e}") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"{name}: the image data is corrupt or truncated: {e}") from None
    return to_rgb(image)


def to_rgb(image: Image.Image) -> np.ndarray:
    """``[H, W, 3]`` uint8: transparency composited onto white, every other mode converted."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image.convert("RGBA"))
    return np.asarray(image.convert("RGB"))


def patch_grid(height: int, width: int, cfg: VisionConfig, limits: ImageLimits = ImageLimits()):
    """``((resized_h, resized_w), (padded_h, padded_w))`` in pixels of an image of ``height x width``."""
    p = cfg.patch_size
    side = limits.max_patches_per_side * p
    patches = max(1, height // p) * max(1, width // p)
    scale = min(1.0, math.sqrt(limits.max_patches / patches), side / height, side / width)
    new_h = min(max(1, int(height * scale)), side)
    new_w = min(max(1, int(width * scale)), side)
    fh, fw = cfg.merge_height * p, cfg.merge_width * p
    return (new_h, new_w), (-(-new_h // fh) * fh, -(-new_w // fw) * fw)


def _keys(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def resize_matrix(size_in: int, size_out: int) -> np.ndarray:
    """``[size_out, size_in]`` float64 antialiased bicubic weights of one axis (rows sum to 1)."""
    scale = size_in / size_out
    stretch = max(scale, 1.0)
    support = 2.0 * stretch
    centre = scale * (np.arange(size_out) + 0.5)
    lo = np.maximum((centre - support + 0.5).astype(np.int64), 0)
    hi = np.minimum((centre + support + 0.5).astype(np.int64), size_in)
    src = np.arange(size_in)
    inside = (src[None] >= lo[:, None]) & (src[None] < hi[:, None])
    weights = np.where(inside, _keys((src[None] - centre[:, None] + 0.5) / stretch), 0.0)
    total = weights.sum(axis=1, keepdims=True)
    return weights / np.where(total == 0, 1.0, total)


def resize(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """``[height, width, 3]`` uint8 of ``rgb [H, W, 3]`` uint8 (antialiased bicubic)."""
    if rgb.shape[:2] == (height, width):
        return rgb
    rows = resize_matrix(rgb.shape[0], height).astype(np.float32)
    cols = resize_matrix(rgb.shape[1], width).astype(np.float32)
    H = rgb.shape[0]
    out = rgb.astype(np.float32).transpose(0, 2, 1) @ cols.T  # [H, 3, width]
    out = (rows @ out.reshape(H, 3 * width)).reshape(height, 3, width).transpose(0, 2, 1)
    return np.clip(np.round(out), 0, 255).astype(np.uint8)


def patches(rgb: np.ndarray, cfg: VisionConfig, limits: ImageLimits = ImageLimits()) -> tuple[np.ndarray, tuple]:
    """``(pixel_values [h * w, 3, patch, patch] float32, (1, h, w))`` of one ``[H, W, 3]`` uint8 image."""
    (new_h, new_w), (pad_h, pad_w) = patch_grid(rgb.shape[0], rgb.shape[1], cfg, limits)
    canvas = np.zeros((pad_h, pad_w, 3), np.uint8)
    canvas[:new_h, :new_w] = resize(rgb, new_h, new_w)
    mean = np.asarray(MEAN, np.float32) * 255.0
    std = np.asarray(STD, np.float32) * 255.0
    pixels = (canvas.astype(np.float32) - mean) / std  # [H, W, 3]
    p = cfg.patch_size
    h, w = pad_h // p, pad_w // p
    pixels = pixels.reshape(h, p, w, p, 3).transpose(0, 2, 4, 1, 3).reshape(h * w, 3, p, p)
    return np.ascontiguousarray(pixels), (1, h, w)


def preprocess(images: list, cfg: VisionConfig, limits: ImageLimits = ImageLimits()) -> tuple[np.ndarray, np.ndarray]:
    """``(pixel_values [P, 3, patch, patch] float32, image_grid_thw [I, 3] int64)`` of images in order.

    Each image is encoded ``bytes``, a Pillow image or a ``[H, W, 3]`` uint8 RGB array.

    Raises:
      ImageError: over a limit, undecodable, or of an unsupported kind.
    """
    if len(images) > limits.max_images:
        raise ImageError(f"{len(images)} images is over the limit of {limits.max_images} images per request")
    pixel_values, grids = [], []
    for i, image in enumerate(images):
        name = f"image {i}"
        if isinstance(image, (bytes, bytearray, memoryview)):
            rgb = decode(bytes(image), limits, name=name)
        elif isinstance(image, Image.Image):
            rgb = to_rgb(image)
        elif isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3:
            rgb = image
        else:
            raise ImageError(
                f"{name}: expected encoded bytes, a PIL image or an [H, W, 3] uint8 array, got {type(image)}"
            )
        if rgb.shape[0] * rgb.shape[1] > limits.max_pixels:
            raise ImageError(f"{name}: {rgb.shape[1]} x {rgb.shape[0]} pixels is over the limit of {limits.max_pixels}")
        pv, grid = patches(rgb, cfg, limits)
        pixel_values.append(pv)
        grids.append(grid)
    if not pixel_values:
        p = cfg.patch_size
        return np.zeros((0, 3, p, p), np.float32), np.zeros((0, 3), np.int64)
    return np.concatenate(pixel_values), np.asarray(grids, np.int64)
