"""Labelled image sets that a package ships, as captioning data, and the baseline a captioner must beat.

``digits``: scikit-learn's bundled copy of the UCI optical handwritten digits (1,797 images of 8 x 8
pixels, 17 grey levels, classes 0-9 about equally often). Each image becomes an 8 x 8 RGB picture
(level ``v`` -> ``255 * v // 16`` on every channel; ink is bright on black, as the set is stored)
whose caption is the digit's English name. The train / held-out split is a seeded permutation.

The baseline is the nearest centroid on raw pixels (each class' mean train image; the held-out
image goes to the class whose mean is nearest in Euclidean distance), the classifier that
``sklearn.neighbors.NearestCentroid`` fits.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

DATASETS = ("digits",)
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


class CaptionSet(NamedTuple):
    """One split of a captioning set.

    Attributes:
      images: ``[N, H, W, 3]`` uint8 RGB.
      labels: ``[N]`` int class of each image.
      captions: the caption of each class (``captions[labels[i]]`` is image i's).
    """

    images: np.ndarray
    labels: np.ndarray
    captions: tuple[str, ...]

    def caption(self, i: int) -> str:
        return self.captions[int(self.labels[i])]


def load(dataset: str, heldout_fraction: float, seed: int) -> tuple[CaptionSet, CaptionSet]:
    """``(train, held-out)`` of ``dataset``, the held-out split ``heldout_fraction`` of it.

    Raises:
      ValueError: an unknown dataset or a fraction that leaves either split empty.
    """
    if dataset not in DATASETS:
        raise ValueError(f"vl.dataset is {dataset!r}; allowed: {', '.join(DATASETS)}")
    from sklearn.datasets import load_digits  # noqa: PLC0415 (the bundled data; imported when used)

    digits = load_digits()
    levels = np.asarray(digits.images, np.int64)  # [N, 8, 8], 0..16
    grey = (255 * levels // 16).astype(np.uint8)
    images = np.repeat(grey[..., None], 3, axis=-1)
    labels = np.asarray(digits.target, np.int64)
    n = len(labels)
    heldout = int(round(n * heldout_fraction))
    if not 0 < heldout < n:
        raise ValueError(
            f"vl.heldout_fraction={heldout_fraction} holds out {heldout} of {n} images; allowed: a fraction "
            "that leaves both splits non-empty"
        )
    order = np.random.default_rng(seed).permutation(n)
    test, train = order[:heldout], order[heldout:]
    return (
        CaptionSet(images[train], labels[train], DIGIT_NAMES),
        CaptionSet(images[test], labels[test], DIGIT_NAMES),
    )


def nearest_centroid_accuracy(train: CaptionSet, heldout: CaptionSet) -> float:
    """Held-out accuracy of the nearest class centroid on raw pixels, fitted on ``train``."""
    x = train.images.reshape(len(train.images), -1).astype(np.float64)
    classes = np.unique(train.labels)
    centroids = np.stack([x[train.labels == c].mean(axis=0) for c in classes])
    y = heldout.images.reshape(len(heldout.images), -1).astype(np.float64)
    distances = ((y[:, None, :] - centroids[None]) ** 2).sum(axis=-1)
    return float(np.mean(classes[np.argmin(distances, axis=1)] == heldout.labels))
