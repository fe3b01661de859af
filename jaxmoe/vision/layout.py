"""Where each patch of a batch of images sits: the host-side (numpy) half of the vision tower.

Everything that depends only on the images' grid sizes is computed here once per batch, so the
jitted tower sees plain arrays whose shapes depend only on the total patch count:

- the bicubic resampling of the learned position table to each grid, as 16 taps and weights per
  patch (PyTorch ``F.interpolate(mode="bicubic", align_corners=False)``: Keys kernel a = -0.75,
  half-pixel centres, edge taps clamped);
- the 2D rotary angles of each patch (one angle per rotated pair of a head);
- which image each patch belongs to (attention stays within an image);
- the order that groups each ``merge_height x merge_width`` block of patches into one merged token.

Patches arrive as the Kimi K2.5 image processor emits them: images in order, each one's patches
in raster order (row-major over its ``h x w`` grid), each patch ``[3, patch, patch]`` flattened.

Shape letters: P patches (all images), I images, K merge block (merge_height x merge_width),
Hd vision head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxmoe.config import VisionConfig

BICUBIC_A = -0.75


class VisionInputs(NamedTuple):
    """The tower's inputs for a batch of images (host or device arrays).

    Attributes:
      patches: ``[P, 3 * patch * patch]`` float32 pixels.
      pos_index: ``[P, 16]`` int32 rows of the flattened position table.
      pos_weight: ``[P, 16]`` float32 weights of those rows.
      cos, sin: ``[P, Hd // 2]`` float32 rotary terms of each patch's pairs.
      segment: ``[P]`` int32 image of each patch.
      merge_order: ``[P]`` int32: ``patches[merge_order]`` lists each merged token's K patches together.
    """

    patches: np.ndarray
    pos_index: np.ndarray
    pos_weight: np.ndarray
    cos: np.ndarray
    sin: np.ndarray
    segment: np.ndarray
    merge_order: np.ndarray


def _cubic(distance: np.ndarray) -> np.ndarray:
    a, d = BICUBIC_A, distance
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, far)


def bicubic_taps(size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Taps ``[size, 4]`` into an axis of ``side`` entries and their weights, for ``size`` outputs."""
    index = np.arange(size, dtype=np.float32)
    src = (index + np.float32(0.5)) * np.float32(side) / np.float32(size) - np.float32(0.5)
    floor = np.floor(src)
    offsets = np.arange(-1, 3, dtype=np.float32)
    taps = np.clip(floor[:, None] + offsets, 0, side - 1).astype(np.int32)
    weights = _cubic(np.abs(src[:, None] - floor[:, None] - offsets)).astype(np.float32)
    return taps, weights


def image_grids(grid_thw: np.ndarray, cfg: VisionConfig) -> list[tuple[int, int]]:
    """``[(h, w)]`` in patches of each image of an HF ``image_grid_thw [I, 3]``, checked."""
    grid = np.asarray(grid_thw)
    if grid.ndim != 2 or grid.shape[1] != 3 or not np.issubdtype(grid.dtype, np.integer):
        raise ValueError(f"image grid must be an integer [images, 3] array (t, h, w), got {grid.dtype} {grid.shape}")
    out = []
    for i, (t, h, w) in enumerate(grid.tolist()):
        if t != 1:
            raise ValueError(f"image grid[{i}]: t={t}; images have t = 1 (video input is not supported)")
        if h < 1 or w < 1 or h % cfg.merge_height or w % cfg.merge_width:
            raise ValueError(
                f"image grid[{i}]: {h} x {w} patches must be positive multiples of the merge block "
                f"{cfg.merge_height} x {cfg.merge_width}"
            )
        out.append((int(h), int(w)))
    return out


def rope_inverse_frequencies(cfg: VisionConfig) -> np.ndarray:
    """``[Hd // 4]`` float32: each axis (width, height) rotates Hd // 4 pairs of a head."""
    half = cfg.head_dim // 2
    return (1.0 / (cfg.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / half))).astype(np.float32)


def vision_inputs(pixel_values: np.ndarray, grids: list[tuple[int, int]], cfg: VisionConfig) -> VisionInputs:
    """The tower's inputs for ``pixel_values [P, 3, patch, patch]`` of images with patch ``grids``.

    Raises:
      ValueError: the pixels' shape does not match the config's patch size or the grids' total.
    """
    p = cfg.patch_size
    pixels = np.asarray(pixel_values, np.float32)
    total = sum(h * w for h, w in grids)
    if pixels.ndim != 4 or pixels.shape[1:] != (3, p, p) or pixels.shape[0] != total:
        raise ValueError(
            f"pixel values must be [patches, 3, {p}, {p}] with {total} patches (the image grids' h x w summed), "
            f"got {pixels.shape}"
        )
    inv = rope_inverse_frequencies(cfg)
    kh, kw = cfg.merge_height, cfg.merge_width
    parts = {k: [] for k in VisionInputs._fields if k != "patches"}
    start = merged = 0
    for i, (h, w) in enumerate(grids):
        rows, cols = np.divmod(np.arange(h * w), w)
        row_taps, row_w = bicubic_taps(h, cfg.pos_emb_height)
        col_taps, col_w = bicubic_taps(w, cfg.pos_emb_width)
        index = row_taps[rows][:, :, None] * cfg.pos_emb_width + col_taps[cols][:, None, :]  # [hw, 4, 4]
        parts["pos_index"].append(index.reshape(h * w, 16))
        parts["pos_weight"].append((row_w[rows][:, :, None] * col_w[cols][:, None, :]).reshape(h * w, 16))
        # Pair 2j rotates with the width position, pair 2j + 1 with the height, both at frequency j.
        angles = np.stack([cols[:, None] * inv, rows[:, None] * inv], axis=-1).astype(np.float32)  # [hw, Hd/4, 2]
        angles = angles.reshape(h * w, -1)
        parts["cos"].append(np.cos(angles))
        parts["sin"].append(np.sin(angles))
        parts["segment"].append(np.full(h * w, i, np.int32))
        dest = (merged + (rows // kh) * (w // kw) + cols // kw) * (kh * kw) + (rows % kh) * kw + cols % kw
        order = np.empty(h * w, np.int64)
        order[dest - merged * kh * kw] = np.arange(h * w) + start
        parts["merge_order"].append(order)
        start += h * w
        merged += (h // kh) * (w // kw)
    cat = {k: np.concatenate(v) for k, v in parts.items()}
    return VisionInputs(
        pixels.reshape(total, 3 * p * p),
        cat["pos_index"].astype(np.int32),
        cat["pos_weight"].astype(np.float32),
        cat["cos"].astype(np.float32),
        cat["sin"].astype(np.float32),
        cat["segment"],
        cat["merge_order"].astype(np.int32),
    )


def merged_tokens(grids: list[tuple[int, int]], cfg: VisionConfig) -> int:
    """Language-model tokens the images become (one ``image_token_id`` placeholder each)."""
    return sum((h // cfg.merge_height) * (w // cfg.merge_width) for h, w in grids)


def pad_patches(inputs: VisionInputs, total: int) -> VisionInputs:
    """``inputs`` with padding patches up to ``total`` (a multiple of the merge block), in an image
    of their own: the real patches' features are unchanged (attention stays within an image), and
    the padding's merged tokens come after the real ones (drop them)."""
    P = inputs.patches.shape[0]
    extra = total - P
    if extra < 0:
        raise ValueError(f"cannot pad {P} patches to {total}")
    if extra == 0:
        return inputs
    pad = lambda a, value=0: np.concatenate([a, np.full((extra, *a.shape[1:]), value, a.dtype)])
    segment = int(inputs.segment.max()) + 1 if P else 0
    return VisionInputs(
        pad(inputs.patches),
        pad(inputs.pos_index),
        pad(inputs.pos_weight),
        pad(inputs.cos, 1),
        pad(inputs.sin),
        pad(inputs.segment, segment),
        np.concatenate([inputs.merge_order, np.arange(P, total, dtype=inputs.merge_order.dtype)]),
    )
