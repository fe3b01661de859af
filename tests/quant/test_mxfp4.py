"""MXFP4 codes, scales and dequantized values bit for bit against torchao's ``to_mx`` (FLOOR) / ``to_dtype``.

The inputs cover Gaussian, heavy-tailed (Student t, 1.5 dof) and widely scaled values (per-block
and per-element scales from 2**-150 to 2**127), blocks holding all 16 codes, zeros, signed
zeros, subnormals, and values exactly on every rounding boundary. XLA:CPU flushes subnormal
floats, so the subnormal cases fail unless every step is exact integer arithmetic.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

from jaxmoe.quant import mxfp4

E2M1 = np.array(mxfp4.E2M1_VALUES, np.float32)


def _torchao(x: np.ndarray):
    t = torch.from_numpy(np.ascontiguousarray(x))
    scale, data = to_mx(t, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)
    return data.view(torch.uint8).numpy(), scale.view(torch.uint8).numpy()


def _torchao_bf16(x: np.ndarray):
    t = torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16)
    scale, data = to_mx(t, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)
    return data.view(torch.uint8).numpy(), scale.view(torch.uint8).numpy(), t


def _from_bits(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint32).view(np.float32)


def _inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    sign = lambda shape: np.where(rng.random(shape) < 0.5, -1.0, 1.0).astype(np.float32)
    # Subnormals: random mantissas with a zero exponent field; a few signed zeros among them.
    sub = _from_bits(rng.integers(0, 2**23, (9, 64))) * sign((9, 64))
    sub[0, :32] = 0.0
    sub[1, :7] = -0.0
    sub[2, :] = _from_bits(rng.integers(0, 2**23, 64)) * 2.0**10  # tiny normals mixed in below
    sub[3, ::2] = _from_bits(rng.integers(1, 2**23, 32))
    # Every code in one block: +-{0, .5, 1, 1.5, 2, 3, 4, 6} * 2**k, shuffled, at several k.
    codes = np.concatenate([E2M1, -E2M1])
    all16 = np.stack([rng.permutation(np.concatenate([codes, codes])) * 2.0**k for k in (-126, -127, -3, 0, 17, 125)])
    # Exactly on every rounding boundary (and just beside it), with an amax of 6 * 2**k pinning the scale.
    t = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    beside = np.concatenate([t, np.nextafter(t, 0), np.nextafter(t, 10), [0.1, 0.2, 5.5, 5.9, 6.0, 6.0]])
    beside = np.concatenate([beside, np.zeros(32 - beside.size, np.float32)])
    ties = np.stack([beside * 2.0**k * s for k in (-126, -125, -20, 0, 40, 124) for s in (1, -1)])
    return {
        "gaussian": rng.normal(size=(13, 7, 96)).astype(np.float32),
        "heavy_tailed": rng.standard_t(1.5, size=(11, 160)).astype(np.float32),
        "wide_blocks": (rng.normal(size=(29, 64)) * np.exp2(rng.integers(-150, 126, (29, 2)).repeat(32, 1))).astype(
            np.float32
        ),
        "wide_elements": (rng.normal(size=(17, 64)) * np.exp2(rng.integers(-150, 127, (17, 64)))).astype(np.float32),
        "subnormal_and_zero": sub.astype(np.float32),
        "all_16_codes": all16.astype(np.float32),
        "rounding_boundaries": ties.astype(np.float32),
    }


CASES = [(seed, name) for seed in (0, 1, 2) for name in _inputs(0)]


@pytest.mark.parametrize(("seed", "name"), CASES, ids=[f"{n}-seed{s}" for s, n in CASES])
def test_quantize_and_dequantize_match_torchao(seed, name):
    x = _inputs(seed)[name]
    want_blocks, want_scales = _torchao(x)
    blocks, scales = mxfp4.quantize(x)
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    assert blocks.dtype == np.uint8 and scales.dtype == np.uint8
    assert blocks.shape == (*x.shape[:-1], x.shape[-1] // 32, 16) and scales.shape == (*x.shape[:-1], x.shape[-1] // 32)
    np.testing.assert_array_equal(blocks.reshape(want_blocks.shape), want_blocks)
    np.testing.assert_array_equal(scales, want_scales)
    # The traceable kernel under jit gives the same bits.
    jb, js = jax.jit(mxfp4.quantize_jit)(x)
    np.testing.assert_array_equal(np.asarray(jb), blocks)
    np.testing.assert_array_equal(np.asarray(js), scales)

    # Dequantization: torchao's to_dtype, bit for bit, in float32 and bfloat16.
    t_data = torch.from_numpy(want_blocks)
    t_scale = torch.from_numpy(want_scales).view(torch.float8_e8m0fnu)
    for dtype, tdtype, view in ((jnp.float32, torch.float32, np.uint32), (jnp.bfloat16, torch.bfloat16, np.uint16)):
        want = to_dtype(t_data, t_scale, torch.float4_e2m1fn_x2, 32, tdtype)
        want_bits = want.view(torch.int32 if tdtype == torch.float32 else torch.int16).numpy().view(view)
        got = np.asarray(mxfp4.dequantize(blocks, scales, dtype=dtype))
        assert got.shape == x.shape and got.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(got.view(view), want_bits.reshape(x.shape))


def test_subnormal_inputs_give_nonzero_codes():
    """The subnormal case is not vacuous: torchao turns subnormal-only blocks into non-zero codes."""
    x = _inputs(0)["subnormal_and_zero"]
    blocks, scales = _torchao(x)
    assert (blocks[3] != 0).any() and (scales == 0).any()
    np.testing.assert_array_equal(np.asarray(mxfp4.quantize(x)[0]).reshape(blocks.shape), blocks)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bfloat16_input_matches_torchao(seed):
    x = _inputs(seed)["wide_elements"]
    want_blocks, want_scales, t = _torchao_bf16(x)
    x_bf16 = jnp.asarray(t.view(torch.int16).numpy().view(np.uint16)).view(jnp.bfloat16)
    blocks, scales = mxfp4.quantize(x_bf16)
    np.testing.assert_array_equal(np.asarray(blocks).reshape(want_blocks.shape), want_blocks)
    np.testing.assert_array_equal(np.asarray(scales), want_scales)


def test_dequantize_any_bytes_matches_torchao():
    """Every code with every scale byte (incl. 253/254 overflow to Inf and 0xFF NaN) dequantizes as torchao."""
    rng = np.random.default_rng(0)
    scales = np.arange(256, dtype=np.uint8).reshape(16, 16)  # [16, G=16]: every byte once
    blocks = rng.integers(0, 256, (16, 16, 16), dtype=np.uint8)
    blocks[:, :, :8] = [(2 * j) | ((2 * j + 1) << 4) for j in range(8)]  # codes 0..15 in every block
    t_data = torch.from_numpy(blocks.reshape(16, 256))
    t_scale = torch.from_numpy(scales).view(torch.float8_e8m0fnu)
    for dtype, tdtype in ((jnp.float32, torch.float32), (jnp.bfloat16, torch.bfloat16)):
        want = to_dtype(t_data, t_scale, torch.float4_e2m1fn_x2, 32, tdtype).float().numpy().reshape(16, 512)
        got = np.asarray(mxfp4.dequantize(blocks, scales, dtype=dtype)).astype(np.float32)
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan)
        assert nan.sum() == 32 and nan[15, -32:].all()  # exactly the one 0xFF block
        np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
        assert np.isinf(got).any()  # 6 * 2**127 overflows, as in torchao


def test_nan_and_inf_are_refused():
    x = np.ones((3, 64), np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[2, 37] = bad
        with pytest.raises(ValueError, match=r"non-finite value\(s\) \(NaN or Inf\).*\(3, 64\).*index \(2, 37\)"):
            mxfp4.quantize(y)
        with pytest.raises(ValueError, match="NaN or Inf"):
            mxfp4.quantize(jnp.asarray(y, jnp.bfloat16))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="multiple of 32, got shape \\(4, 48\\)"):
        mxfp4.quantize(np.zeros((4, 48), np.float32))
    with pytest.raises(ValueError, match="float array, got dtype int32"):
        mxfp4.quantize(np.zeros((4, 32), np.int32))
    with pytest.raises(TypeError, match="quantize_jit"):
        jax.jit(mxfp4.quantize)(jnp.zeros((4, 32)))
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.dequantize(np.zeros((2, 16), np.int8), np.zeros((2,), np.uint8))
    with pytest.raises(ValueError, match=r"blocks must be \[..., G, 16\]"):
        mxfp4.dequantize(np.zeros((2, 8), np.uint8), np.zeros((2,), np.uint8))


def test_in_jit_variant_follows_ocp_for_nan_and_inf():
    x = np.random.default_rng(0).normal(size=(2, 128)).astype(np.float32)
    x[0, 5], x[1, 100] = np.nan, -np.inf
    blocks, scales = jax.jit(mxfp4.quantize_jit)(x)
    scales, blocks = np.asarray(scales), np.asarray(blocks)
    assert scales[0, 0] == 0xFF and scales[1, 3] == 0xFF
    assert (blocks[0, 0] == 0).all() and (blocks[1, 3] == 0).all()
    # The other blocks are as if the bad ones were not there; torchao agrees on NaN blocks' scale.
    clean = np.where(np.isfinite(x), x, 0).astype(np.float32)
    cb, cs = mxfp4.quantize(clean)
    keep = scales != 0xFF
    np.testing.assert_array_equal(scales[keep], np.asarray(cs)[keep])
    np.testing.assert_array_equal(blocks[keep], np.asarray(cb)[keep])
    assert _torchao(np.where(np.isnan(x), np.nan, clean).astype(np.float32))[1][0, 0] == 0xFF
    y = np.asarray(mxfp4.dequantize(blocks, scales)).reshape(2, 4, 32)
    assert np.isnan(y[0, 0]).all() and np.isnan(y[1, 3]).all() and np.isfinite(y[0, 1:]).all()


def test_gaussian_relative_rms_error():
    """About 0.115 for N(0, 1) weights (the format's 3-bit-mantissa-less grid and FLOOR scale)."""
    x = np.random.default_rng(0).normal(size=(256, 4096)).astype(np.float32)
    y = np.asarray(mxfp4.dequantize(*mxfp4.quantize(x)))
    rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2))
    assert 0.105 < rel < 0.125, rel


def test_requantizing_dequantized_values_is_the_identity():
    """A block's amax always lands on code 4 or 6, so quantize(dequantize(q)) == q (outside the clamped range)."""
    x = _inputs(1)["gaussian"] * np.float32(3e-3)
    blocks, scales = mxfp4.quantize(x)
    b2, s2 = mxfp4.quantize(mxfp4.dequantize(blocks, scales))
    np.testing.assert_array_equal(np.asarray(b2), np.asarray(blocks))
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(scales))
