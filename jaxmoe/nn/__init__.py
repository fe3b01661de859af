"""Building blocks shared by every attention kind and the FFN."""

from jaxmoe.nn.linear import dense, param
from jaxmoe.nn.norms import LayerNorm, RMSNorm, rms_norm
from jaxmoe.nn.rope import apply_rope, rope_frequencies, yarn_mscale

__all__ = [
    "LayerNorm",
    "RMSNorm",
    "apply_rope",
    "dense",
    "param",
    "rms_norm",
    "rope_frequencies",
    "yarn_mscale",
]
