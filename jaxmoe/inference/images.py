"""A request's images in the engine: their merged vision features, where those go in the prompt,
and the prefix keys of the image tokens.

An agent re-sends its images with every turn, as it re-sends its text; :class:`ImageFeatures` keeps
the features of each tenant's recent images (keyed by the image's content) so that the tower runs
once per image, as the prefix cache computes each prefix once. Features are never shared across
tenants.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable

import jax
import numpy as np

from jaxmoe.vision.layout import VisionInputs, image_grids, merged_tokens, vision_inputs


class ImageFeatures:
    """Attaches images' features to sequences, from a per-tenant LRU of recent images or the tower.

    Args:
      vision: the model's vision config (``None`` for a text-only model: every image is refused).
      d_model: width of the language model (the features' width).
      capacity: most images kept across requests (0 keeps none).
    """

    def __init__(self, vision, d_model: int, capacity: int):
        self.vision, self.d_model, self.capacity = vision, d_model, capacity
        self._lru: collections.OrderedDict = collections.OrderedDict()  # (tenant, digest) -> features

    def attach(self, seq, encode: Callable[[VisionInputs], np.ndarray]) -> int:
        """Gives ``seq`` its images' merged features (``seq.features``), the feature row of each
        prompt position (``seq.feature_rows``, -1 for text) and the image tokens' prefix keys
        (``seq.image_keys``). ``encode`` runs the tower over images not seen lately.

        Returns:
          how many images went through the tower.

        Raises:
          ValueError: images for a model without a vision tower, images on a multi-process engine,
            or placeholders that do not number the images' merged tokens.
        """
        images, vision = seq.request.images, self.vision
        prompt = np.asarray(seq.tokens, np.int64)
        placeholders = np.nonzero(prompt == vision.image_token_id)[0] if vision is not None else np.zeros(0, int)
        if images is None:
            if len(placeholders):
                raise ValueError(
                    f"prompt_ids hold {len(placeholders)} image placeholders (id {vision.image_token_id}) but the "
                    "request has no images"
                )
            return 0
        if vision is None:
            raise ValueError("images: this model has no vision tower (model.vision is not set)")
        if jax.process_count() > 1:
            raise ValueError("images: image input is not supported on a multi-process engine")
        grids = image_grids(images.grid_thw, vision)
        M = merged_tokens(grids, vision)
        if len(placeholders) != M:
            raise ValueError(
                f"prompt_ids hold {len(placeholders)} image placeholders (id {vision.image_token_id}); the images "
                f"{[list(g) for g in grids]} need {M} (one per merged patch, in order)"
            )
        digests = images.digests()
        features, encoded = self._features(seq.request.tenant, images, grids, digests, encode)
        seq.features = np.concatenate(features) if features else np.zeros((0, self.d_model), np.float32)
        rows = np.full((len(prompt),), -1, np.int32)
        rows[placeholders] = np.arange(M, dtype=np.int32)
        seq.feature_rows = rows
        seq.image_keys = _image_keys(len(prompt), placeholders, digests, [len(f) for f in features])
        return encoded

    def _features(self, tenant, images, grids, digests, encode) -> tuple[list[np.ndarray], int]:
        """Per image ``[merged, D]`` float32 features, and how many images the tower ran on."""
        keys = [(tenant, d) for d in digests] if tenant is not None else [None] * len(digests)
        out = [self._lru.get(k) if k is not None else None for k in keys]
        new = [i for i, f in enumerate(out) if f is None]
        if new:
            starts = np.cumsum([0] + [h * w for h, w in grids])
            pixels = np.concatenate([images.pixel_values[starts[i] : starts[i + 1]] for i in new])
            merged = encode(vision_inputs(pixels, [grids[i] for i in new], self.vision))
            at = 0
            for i in new:
                n = merged_tokens([grids[i]], self.vision)
                out[i] = merged[at : at + n]
                at += n
        for k, f in zip(keys, out, strict=True):
            if k is not None and self.capacity:
                self._lru[k] = f
                self._lru.move_to_end(k)
                while len(self._lru) > self.capacity:
                    self._lru.popitem(last=False)
        return out, len(new)


def _image_keys(length: int, placeholders: np.ndarray, digests: list[bytes], counts: list[int]) -> np.ndarray:
    """The prefix key of every image token (0 elsewhere): a negative hash of its image's content
    and its index in the image, so that the same placeholder ids with other pixels never match."""
    keys = np.zeros((length,), np.int64)
    token = 0
    for digest, n in zip(digests, counts, strict=True):
        for j in range(n):
            mixed = hashlib.sha256(digest + j.to_bytes(4, "little")).digest()
            keys[placeholders[token]] = -1 - int.from_bytes(mixed[:7], "little")
            token += 1
    return keys
