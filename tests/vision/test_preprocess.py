"""Image preprocessing against the Kimi K2.5 image processor, on real photographs.

HF's ``Kimi_K25ImageProcessor`` is torchvision-only, and no torchvision build imports beside the
CPU torch 2.13 pinned here ("operator torchvision::nms does not exist"). So the reference is put
together from what runs: HF's own ``navit_resize`` (read from the installed
``image_processing_kimi_k25.py``) for the sizes, HF's ``convert_to_rgb`` for the RGB step, and for
the resize what torchvision's tensor ``resize`` runs on a uint8 image with bicubic + antialias:
torch's ``interpolate(mode="bicubic", antialias=True)`` in float, clamped and rounded back to
uint8; then HF's zero padding, ``IMAGENET_STANDARD`` mean/std and patch layout.

Stated tolerance: equal, except pixels whose resized value lies at a rounding tie, which may be
one uint8 level apart (1 / 127.5 after normalisation) on at most 0.1% of the values. Images
that need no resize are equal exactly.

The photographs are scikit-learn's bundled ``china.jpg`` and ``flower.jpg`` (427 x 640 JPEGs).
"""

import ast
import io
import math
import pathlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from jaxmoe.config import VisionConfig
from jaxmoe.vision import image_grids, vision_inputs
from jaxmoe.vision import preprocess as pp

LEVEL = 1 / 127.5
CFG = VisionConfig()


def _photos():
    import sklearn  # noqa: PLC0415

    folder = pathlib.Path(sklearn.__file__).parent / "datasets" / "images"
    return {name: (folder / name).read_bytes() for name in ("china.jpg", "flower.jpg")}


def _hf_navit_resize():
    """HF's ``navit_resize``, compiled from the installed module (which imports torchvision at the top)."""
    import transformers.models.kimi_k25 as k25  # noqa: PLC0415

    source = (pathlib.Path(k25.__file__).parent / "image_processing_kimi_k25.py").read_text()
    (fn,) = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize"]
    namespace = {"math": math}
    exec(compile(ast.Module([fn], []), "navit_resize", "exec"), namespace)
    return namespace["navit_resize"]


def _reference(data: bytes, cfg: VisionConfig, limits: pp.ImageLimits):
    from transformers.image_transforms import convert_to_rgb  # noqa: PLC0415
    from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD  # noqa: PLC0415

    rgb = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    (nh, nw), (ph, pw) = _hf_navit_resize()(
        rgb.shape[0], rgb.shape[1], cfg.patch_size, cfg.merge_height, limits.max_patches, limits.max_patches_per_side
    )
    x = torch.from_numpy(rgb.copy()).permute(2, 0, 1)[None].float()
    if (nh, nw) != rgb.shape[:2]:
        x = F.interpolate(x, size=(nh, nw), mode="bicubic", antialias=True, align_corners=False)
        x = x.clamp(0, 255).round()
    x = F.pad(x, (0, pw - nw, 0, ph - nh))[0]
    mean = torch.tensor(IMAGENET_STANDARD_MEAN)[:, None, None] * 255
    std = torch.tensor(IMAGENET_STANDARD_STD)[:, None, None] * 255
    x = (x - mean) / std
    p = cfg.patch_size
    h, w = ph // p, pw // p
    patches = x.reshape(3, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, 3, p, p)
    return patches.numpy(), np.array([[1, h, w]])


@pytest.mark.parametrize("max_patches", [16384, 700, 97])
@pytest.mark.parametrize("photo", ["china.jpg", "flower.jpg"])
def test_equals_reference_processor(photo, max_patches):
    data = _photos()[photo]
    limits = pp.ImageLimits(max_patches=max_patches)
    pixel_values, grid = pp.preprocess([data], CFG, limits)
    ref_values, ref_grid = _reference(data, CFG, limits)
    np.testing.assert_array_equal(grid, ref_grid)
    assert pixel_values.dtype == np.float32 and pixel_values.shape == ref_values.shape
    diff = np.abs(pixel_values - ref_values)
    if max_patches == 16384:  # 427 x 640 fits: no resize, only padding
        np.testing.assert_array_equal(pixel_values, ref_values)
    assert diff.max() <= LEVEL + 1e-6
    assert (diff > 1e-6).mean() <= 1e-3
    assert grid[0, 1] * grid[0, 2] <= max_patches + 4 * (grid[0, 1] + grid[0, 2])  # padding adds < one merge row/col


def test_sizes_match_hf_over_many_shapes():
    navit = _hf_navit_resize()
    limits = pp.ImageLimits(max_patches=300, max_patches_per_side=24)
    for height in (1, 5, 13, 14, 15, 28, 100, 333, 500, 2000):
        for width in (1, 14, 29, 64, 400, 1000, 7001):
            ours = pp.patch_grid(height, width, CFG, limits)
            assert ours == navit(height, width, 14, 2, 300, 24), (height, width)


def test_several_images_in_order_and_a_tower_input():
    photos = _photos()
    small = np.asarray(Image.open(io.BytesIO(photos["flower.jpg"])).convert("RGB").resize((60, 45)))
    limits = pp.ImageLimits(max_patches=200)
    pixel_values, grid = pp.preprocess([photos["china.jpg"], small], CFG, limits)
    one, g1 = pp.preprocess([photos["china.jpg"]], CFG, limits)
    two, g2 = pp.preprocess([small], CFG, limits)
    np.testing.assert_array_equal(pixel_values, np.concatenate([one, two]))
    np.testing.assert_array_equal(grid, np.concatenate([g1, g2]))
    grids = image_grids(grid, CFG)
    assert grids[1] == (4, 6)  # 45 x 60 pixels, no resize, padded to 56 x 84
    assert vision_inputs(pixel_values, grids, CFG).patches.shape == (pixel_values.shape[0], 3 * 14 * 14)


def _encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def test_modes_become_rgb_like_hf():
    from transformers.image_transforms import convert_to_rgb  # noqa: PLC0415

    rng = np.random.default_rng(0)
    rgba = Image.fromarray(rng.integers(0, 256, (30, 40, 4), dtype=np.uint8), "RGBA")
    gray = Image.fromarray(rng.integers(0, 256, (30, 40), dtype=np.uint8), "L")
    palette = rgba.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE)
    for image, fmt in [(rgba, "PNG"), (gray, "PNG"), (palette, "GIF"), (rgba.convert("RGB"), "BMP"),
                       (rgba, "WEBP")]:  # fmt: skip
        data = _encode(image, fmt)
        expected = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
        np.testing.assert_array_equal(pp.decode(data), expected, err_msg=f"{image.mode} {fmt}")
    white = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    np.testing.assert_array_equal(pp.decode(_encode(white, "PNG")), np.full((4, 4, 3), 255, np.uint8))


def test_limits_and_bad_data_are_refused_by_name():
    png = _encode(Image.new("RGB", (64, 48), (1, 2, 3)), "PNG")
    with pytest.raises(pp.ImageError, match="3 images is over the limit of 2 images"):
        pp.preprocess([png] * 3, CFG, pp.ImageLimits(max_images=2))
    with pytest.raises(pp.ImageError, match=f"image 1: {len(png)} bytes is over the limit of 100 bytes"):
        pp.preprocess([_encode(Image.new("RGB", (1, 1)), "PNG"), png], CFG, pp.ImageLimits(max_bytes=100))
    with pytest.raises(pp.ImageError, match="64 x 48 pixels is over the limit of 3000 pixels"):
        pp.decode(png, pp.ImageLimits(max_pixels=3000))
    with pytest.raises(pp.ImageError, match="image: not a readable image .*PNG, JPEG, WEBP, GIF, BMP"):
        pp.decode(b"certainly not an image")
    with pytest.raises(pp.ImageError, match="not a readable image"):
        pp.decode(_encode(Image.new("RGB", (8, 8)), "TIFF"))  # a real image, not an allowed format
    with pytest.raises(pp.ImageError, match="corrupt or truncated"):
        pp.decode(png[: len(png) // 2])
    with pytest.raises(pp.ImageError, match=r"image 0: expected encoded bytes.*got <class 'str'>"):
        pp.preprocess(["picture.png"], CFG)
    with pytest.raises(ValueError, match="max_patches must be a positive integer, got 0"):
        pp.ImageLimits(max_patches=0)
