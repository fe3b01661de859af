"""MXFP4 (OCP microscaling, E2M1 elements, E8M0 scales, blocks of 32) along the last axis.

Shapes: ``[..., N]`` values, ``G = N / 32`` blocks; ``blocks`` uint8 ``[..., G, 16]`` holds two
4-bit E2M1 codes per byte (element ``2j`` in the low nibble, ``2j + 1`` in the high one, as
torchao's ``pack_uint4`` and HF gpt-oss), ``scales`` uint8 ``[..., G]`` the biased E8M0 exponent
(bias 127; ``0xFF`` is NaN).

Scale rule (torchao ``to_mx`` with ``ScaleCalculationMode.FLOOR``, bit for bit): with ``amax``
the block's largest magnitude, ``scale = clip(floor(log2(amax)) - 2, -127, 127)`` where the
``floor(log2)`` is the float32 exponent field (0 for zeros and subnormals, hence the clip); the
elements are divided by ``max(2**scale, 2**-126)`` (torchao's clamp to the smallest normal),
rounded to the nearest E2M1 value (ties to even) and saturated at 6.

Every step is integer arithmetic on the float32 bit patterns: XLA:CPU flushes subnormal floats
to zero, so a float division by a tiny scale (or a subnormal input, or a subnormal dequantized
value) would not give torchao's bits. Values are rebuilt by integer exponent shifts, never by a
multiply that could land in the subnormal range.

- :func:`quantize` (host-side entry point) refuses NaN and Inf with a ``ValueError``.
- :func:`quantize_jit` is the traceable kernel for use inside ``jit`` (``quantize_jitted`` is it
  compiled once per shape); it follows OCP for non-finite input: a block holding NaN or Inf
  gets scale ``0xFF`` (NaN) and zero codes.
- :func:`dequantize` is exact: it equals torchao's ``to_dtype`` bit for bit in float32 and
  bfloat16 (a ``0xFF`` scale gives NaN for its whole block).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # elements per scale
SCALE_BIAS = 127
SCALE_NAN = 0xFF
E2M1_MAX = 6.0
# E2M1 code (low 3 bits) -> magnitude; the high bit is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Round-to-nearest-even boundaries between consecutive E2M1 magnitudes, and whether a value
# exactly on the boundary rounds up (to the code with an even mantissa bit).
_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _check_last_axis(shape: tuple[int, ...], name: str) -> None:
    if len(shape) == 0 or shape[-1] % BLOCK:
        raise ValueError(
            f"{name}: MXFP4 quantizes the last axis in blocks of {BLOCK}; its size must be a positive "
            f"multiple of {BLOCK}, got shape {shape}"
        )


def _f32_bits(x: jax.Array) -> jax.Array:
    """uint32 float32 bit patterns of ``x`` (bfloat16 widened by a shift, so subnormals survive)."""
    if x.dtype == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    if x.dtype != jnp.float32:
        raise ValueError(f"MXFP4 quantize takes float32 or bfloat16 values, got {x.dtype}")
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _pow2(k: jax.Array) -> jax.Array:
    """``2.0 ** k`` as float32 for int32 ``k`` in the normal range [-126, 127], built from bits."""
    return jax.lax.bitcast_convert_type(((k + 127) << 23).astype(jnp.uint32), jnp.float32)


def quantize_jit(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Traceable MXFP4 quantization along the last axis (OCP semantics for NaN/Inf blocks).

    Args:
      x: ``[..., N]`` float32 or bfloat16, ``N`` a multiple of 32.

    Returns:
      ``(blocks, scales)``: uint8 ``[..., N/32, 16]`` and uint8 ``[..., N/32]``. A block holding
      NaN or Inf gets scale ``0xFF`` and all-zero codes.
    """
    _check_last_axis(x.shape, "x")
    with jax.named_scope("mxfp4_quantize"):
        u = _f32_bits(x).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)  # [..., G, 32]
        mag = u & 0x7FFFFFFF
        sign = (u >> 31).astype(jnp.uint8)
        # Magnitudes order like their bit patterns, so the block max is an integer max; NaN and
        # Inf patterns exceed every finite one.
        e_amax = (jnp.max(mag, axis=-1) >> 23).astype(jnp.int32)  # [..., G] float32 exponent field
        nonfinite = e_amax == 255
        biased = jnp.where(nonfinite, SCALE_NAN, jnp.clip(e_amax - 2, 0, 254))  # [..., G]
        d = jnp.maximum(biased - SCALE_BIAS, -126)[..., None]  # [..., G, 1]: divisor exponent
        # |x| = sig * 2**(e - 23) exactly (subnormals: e = -126 without the implicit bit), so
        # |x| / 2**d = float(sig) * 2**(e - 23 - d): an exact product of normal floats.
        e_field = (mag >> 23).astype(jnp.int32)
        mant = (mag & 0x7FFFFF).astype(jnp.int32)
        sig = jnp.where(e_field > 0, mant | 0x800000, mant).astype(jnp.float32)
        e = jnp.where(e_field > 0, e_field - 127, -126)
        # Below 2**-30 the quotient is < 2**-6, far under the first rounding boundary (0.25).
        q = sig * _pow2(jnp.maximum(e - 23 - d, -30))  # [..., G, 32]: |x| in units of the scale
        code = jnp.zeros(q.shape, jnp.uint8)
        for bound, tie_up in _BOUNDS:  # count the boundaries passed: RNE, saturating at code 7 (= 6.0)
            code = code + ((q >= bound) if tie_up else (q > bound)).astype(jnp.uint8)
        code = jnp.where(nonfinite[..., None], 0, code | (sign << 3))
        blocks = code[..., 0::2] | (code[..., 1::2] << 4)  # [..., G, 16]
        return blocks.astype(jnp.uint8), biased.astype(jnp.uint8)


quantize_jitted = jax.jit(quantize_jit)
_all_finite = jax.jit(lambda x: jnp.isfinite(x).all())  # one compiled kernel per shape, eager or inside jit


def quantize(x) -> tuple[jax.Array, jax.Array]:
    """MXFP4-quantizes concrete values along the last axis; refuses NaN and Inf.

    Args:
      x: ``[..., N]`` float array (numpy or JAX, possibly sharded), ``N`` a multiple of 32.
        float32 and bfloat16 are taken as they are; other float dtypes are converted to float32
        first (numpy inputs on the host, so subnormals are kept).

    Returns:
      ``(blocks, scales)``: uint8 ``[..., N/32, 16]`` (two E2M1 codes per byte, even element in
      the low nibble) and uint8 ``[..., N/32]`` (E8M0, bias 127).

    Raises:
      ValueError: ``x`` is not a float array, its last axis is not a multiple of 32, or it holds
        NaN or Inf (the message counts them and names the first index).
    """
    if isinstance(x, jax.core.Tracer):
        raise TypeError("mxfp4.quantize checks its values on the host; inside jit use mxfp4.quantize_jit")
    dtype = np.dtype(x.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"mxfp4.quantize takes a float array, got dtype {dtype} of shape {tuple(x.shape)}")
    _check_last_axis(tuple(x.shape), "x")
    if isinstance(x, np.ndarray) and dtype not in (np.float32, jnp.bfloat16):
        x = x.astype(np.float32)
    elif dtype not in (np.float32, jnp.bfloat16):
        x = jnp.asarray(x).astype(jnp.float32)
    if not bool(_all_finite(x)):
        bad = np.argwhere(~np.asarray(jnp.isfinite(x)))
        first = tuple(int(i) for i in bad[0])
        value = np.asarray(x[first], np.float32)
        raise ValueError(
            f"mxfp4.quantize got {len(bad)} non-finite value(s) (NaN or Inf) in an array of shape "
            f"{tuple(x.shape)} and dtype {dtype}; the first is {value} at index {first}. "
            "MXFP4 weights must be finite."
        )
    return quantize_jitted(x)


def _check_packed(blocks, scales) -> None:
    if blocks.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks must be [..., G, {BLOCK // 2}] and scales [..., G]; got blocks {tuple(blocks.shape)}, "
            f"scales {tuple(scales.shape)}"
        )


@functools.partial(jax.jit, static_argnames="dtype")
def dequantize(blocks: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Exact MXFP4 values ``code * 2**(scale - 127)`` along the last axis.

    Args:
      blocks: uint8 ``[..., G, 16]``.
      scales: uint8 ``[..., G]``; ``0xFF`` makes its block NaN.
      dtype: the result dtype. float32 and bfloat16 are built exactly from bits (subnormal
        results included, as torchao gives them); other float dtypes are cast from float32.

    Returns:
      ``[..., G * 32]`` in ``dtype``.
    """
    _check_packed(blocks, scales)
    with jax.named_scope("mxfp4_dequantize"):
        lo, hi = blocks & 0xF, blocks >> 4
        code = jnp.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], BLOCK).astype(jnp.int32)  # [..., G, 32]
        s = scales.astype(jnp.int32)[..., None]  # [..., G, 1]
        e, m = (code >> 1) & 3, code & 1
        # Twice the magnitude as an integer: M in {0, 1, 2, 3, 4, 6, 8, 12}; value = M * 2**(s - 128).
        big_m = jnp.where(e == 0, m, (2 + m) << jnp.maximum(e - 1, 0))
        log2_m = jnp.where(e == 0, 0, e)  # floor(log2(M)) for M > 0
        field = s - 1 + log2_m  # the float32 exponent field of M * 2**(s - 128)
        m_bits = jax.lax.bitcast_convert_type(big_m.astype(jnp.float32), jnp.int32)
        normal = m_bits + ((s - 128) << 23)
        subnormal = big_m << jnp.clip(s + 21, 0, 22)  # field <= 0 only for s <= 1
        bits = jnp.where(field >= 1, normal, subnormal)
        bits = jnp.where(field >= 255, 0x7F800000, bits)  # overflow (s >= 253 with large codes): Inf
        bits = jnp.where(big_m == 0, 0, bits)
        bits = bits.astype(jnp.uint32) | ((code >> 3).astype(jnp.uint32) << 31)
        bits = jnp.where(s == SCALE_NAN, jnp.uint32(0x7FC00000), bits)
        bits = bits.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)  # [..., N]
        dtype = jnp.dtype(dtype)
        if dtype == jnp.bfloat16:
            # Every value has <= 2 significant bits and exponent >= -128: the high half is exact.
            return jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)
        out = jax.lax.bitcast_convert_type(bits, jnp.float32)
        return out if dtype == jnp.float32 else out.astype(dtype)


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(blocks shape, scales shape)`` for values of ``shape`` quantized along the last axis."""
    _check_last_axis(tuple(shape), "shape")
    g = shape[-1] // BLOCK
    return (*shape[:-1], g, BLOCK // 2), (*shape[:-1], g)
