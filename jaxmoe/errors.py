"""Errors that several parts of jaxmoe raise and the command line reports (exit status 1).

Kept apart from the modules that raise them so that catching one (``jaxmoe.cli``, the training
loop) imports nothing heavy. :class:`jaxmoe.config.ConfigError` stays with the config.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing a tensor or an array, or holds one of the wrong shape or values."""


__all__ = ["CheckpointError"]
