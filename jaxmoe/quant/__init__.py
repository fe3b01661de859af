"""MXFP4 quantization: the format (:mod:`jaxmoe.quant.mxfp4`) and packed weights in the model (:mod:`.qarray`)."""

from jaxmoe.quant import mxfp4
from jaxmoe.quant.mxfp4 import dequantize, quantize, quantize_jit
from jaxmoe.quant.qarray import (
    MXFP4_CONTRACTING_AXIS,
    ROUTED_EXPERTS,
    MXFP4Param,
    QArray,
    checkpoint_bytes,
    dequantize_state,
    mxfp4_param,
    packed_axes,
    quantize_state,
    quantize_weight,
)

__all__ = [
    "MXFP4Param",
    "MXFP4_CONTRACTING_AXIS",
    "QArray",
    "ROUTED_EXPERTS",
    "checkpoint_bytes",
    "dequantize",
    "dequantize_state",
    "mxfp4",
    "mxfp4_param",
    "packed_axes",
    "quantize",
    "quantize_jit",
    "quantize_state",
    "quantize_weight",
]
