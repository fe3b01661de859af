"""Cache-based prefill + decode equals the full forward, per attention kind and for the whole model.

Prefill chunks of 5, 11 and 3 tokens over pages of 8 positions split pages and end mid-page;
decode then continues one token at a time. Logits of every position are compared with the
model's full forward (fp32): 1e-5 per component (one-layer models of each kind), 1e-4 for the
tiny hybrid model, on one device and on 8-device meshes that shard heads over ``tensor`` and
experts over ``expert``, with float and MXFP4 experts.
"""

import dataclasses
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from inference_helpers import cached_logits, full_forward, inference_model_config, small_engine

from jaxmoe.config import IndexerConfig, KDAConfig, MeshConfig, MLAConfig, ModelConfig, MoEConfig, load_config
from jaxmoe.model import create_model
from jaxmoe.sharding import make_mesh

CHUNKS, DECODE = [5, 11, 3], 6


def _one_layer(kind: str) -> ModelConfig:
    return ModelConfig(
        vocab_size=61,
        d_model=26,
        num_layers=1,
        layer_kinds=(kind,),
        max_context=256,
        init_std=0.2,
        mla=MLAConfig(
            num_heads=3, q_lora_rank=13, kv_lora_rank=11, qk_nope_head_dim=7, qk_rope_head_dim=4, v_head_dim=5
        ),
        # Few keys per query (5) against 25 positions, so the selection matters.
        indexer=IndexerConfig(num_heads=8, head_dim=6, topk=5),
        kda=KDAConfig(num_heads=3, head_dim=7, conv_kernel=4, chunk_size=8),
        moe=MoEConfig(num_experts=4, experts_per_token=2, expert_ffw_dim=13, num_shared_experts=1, dispatch="dropless"),
    )


def _tokens(vocab, seed, n=2):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, sum(CHUNKS) + DECODE).tolist() for _ in range(n)]


def _check(model, engine, seqs, atol):
    got = cached_logits(engine, seqs, CHUNKS, DECODE)
    want = np.asarray(full_forward(model)(np.asarray(seqs, np.int32)))
    for b in range(len(seqs)):
        np.testing.assert_allclose(got[b], want[b], atol=atol, rtol=0)


@pytest.mark.parametrize("kind", ["mla", "dsa", "kda"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_kind_matches_full_forward(kind, seed):
    model = create_model(_one_layer(kind), seed=seed)
    _check(model, small_engine(model), _tokens(61, seed), atol=1e-5)


def test_dsa_dense_warmup_layer_attends_densely():
    model = create_model(_one_layer("dsa"), seed=3)
    model.layers[0].attn.dense_attention = True
    _check(model, small_engine(model), _tokens(61, 3), atol=1e-5)


def _tiny(mxfp4: bool) -> ModelConfig:
    cfg = inference_model_config(load_config("configs/tiny.py").model)
    # topk 8 of up to 25 positions: selection matters in the dsa layer.
    cfg = dataclasses.replace(cfg, indexer=dataclasses.replace(cfg.indexer, topk=8))
    if not mxfp4:
        return cfg
    # Packed experts: 128-wide expert FFNs are 4 MXFP4 blocks, so tensor 4 splits whole blocks.
    moe = dataclasses.replace(cfg.moe, expert_ffw_dim=128)
    return dataclasses.replace(cfg, moe=moe, mxfp4_weights=("w_gate", "w_up", "w_down"))


@pytest.mark.parametrize("mxfp4", [False, True], ids=["float", "mxfp4"])
def test_tiny_hybrid_one_device(mxfp4):
    model = create_model(_tiny(mxfp4), seed=0)
    _check(model, small_engine(model), _tokens(512, 4, n=3), atol=1e-4)


def test_ffn_of_the_real_tokens_only_matches_full_forward():
    """With ``step_tokens`` below a group's padded tokens, each layer's FFN runs on the real ones
    only (3 rows of 11 tokens padded to 16: 33 of 48); logits still equal the full forward, and a
    step of more real tokens than ``step_tokens`` is refused rather than cut."""
    model = create_model(_tiny(False), seed=0)
    seqs = _tokens(512, 5, n=3)
    _check(model, small_engine(model, step_tokens=3 * max(CHUNKS)), seqs, atol=1e-4)
    with pytest.raises(ValueError, match="step_tokens=32"):
        cached_logits(small_engine(model, step_tokens=32), seqs, CHUNKS, DECODE)


MESHES = {
    "expert2_tensor4": MeshConfig(expert=2, tensor=4),
    "data2_expert2_tensor2": MeshConfig(data=2, expert=2, tensor=2),
    # The training mesh of configs/tiny.py:train, which jaxmoe rl's rollouts run on.
    "data2_expert2_context2": MeshConfig(data=2, expert=2, context=2),
}


SHARDED = [("expert2_tensor4", False), ("data2_expert2_tensor2", True), ("data2_expert2_context2", False)]


def check_sharded(mesh_name: str, mxfp4: bool) -> None:
    """The tiny hybrid model through the engine on ``mesh_name`` equals the one-device full forward (1e-4)."""
    mesh = make_mesh(MESHES[mesh_name])
    cfg = _tiny(mxfp4)
    reference = create_model(cfg, seed=0)
    with jax.set_mesh(mesh):
        model = create_model(cfg, seed=0, mesh=mesh)
    engine = small_engine(model, mesh=mesh)
    seqs = _tokens(512, 5, n=3)
    got = cached_logits(engine, seqs, CHUNKS, DECODE)
    want = np.asarray(full_forward(reference)(np.asarray(seqs, np.int32)))
    for b in range(len(seqs)):
        np.testing.assert_allclose(got[b], want[b], atol=1e-4, rtol=0)


@pytest.mark.parametrize("mesh_name, mxfp4", SHARDED, ids=["float", "mxfp4", "context"])
def test_tiny_hybrid_sharded(mesh_name, mxfp4):
    """:func:`check_sharded` in a fresh process: late in the whole suite (hundreds of programs
    compiled in one process) XLA:CPU once crashed compiling the first sharded step."""
    here = pathlib.Path(__file__).parent
    code = (
        "import conftest, sys; sys.path.insert(0, sys.argv[1]); import test_forward; "
        "test_forward.check_sharded(sys.argv[2], sys.argv[3] == 'True'); print('sharded check passed')"
    )
    argv = [sys.executable, "-c", code, str(here), mesh_name, str(mxfp4)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here)])}
    done = subprocess.run(argv, env=env, cwd=here.parents[1], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "sharded check passed" in done.stdout


def test_decode_attention_in_blocks_matches_the_overlay():
    """The decode loop's online softmax over many one-page blocks equals one softmax over the overlay."""
    from jaxmoe.inference.forward import Rows, _kv_positions, _latent, _read, decode_latent_attention

    cfg = _one_layer("mla")
    attn = create_model(cfg, seed=3).layers[0].attn
    P, M, W = 4, 16, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    rng = np.random.default_rng(3)
    pool = jnp.asarray(rng.normal(size=(40, P, W)), jnp.float32)
    start = np.array([0, 37, 5, 9], np.int32)  # a first token, a row over ten blocks, a mid-page end, padding
    length = np.array([1, 1, 1, 0], np.int32)
    pages = np.zeros((4, M), np.int32)
    for b, n in enumerate(start):
        pages[b, : n // P + 1] = rng.permutation(np.arange(1, 40))[: n // P + 1]
    rows = Rows(
        jnp.zeros((4, 1), jnp.int32), jnp.asarray(start), jnp.asarray(length), jnp.asarray(pages), jnp.arange(4)
    )
    x = jnp.asarray(rng.normal(size=(4, 1, cfg.d_model)), jnp.float32)
    new = _latent(attn, x, rows.positions())
    C = cfg.mla.kv_lora_rank
    seen = _read(pool, new, rows)
    want = attn.attend_latent(x, rows.positions(), seen[..., :C], seen[..., C:], _kv_positions(seen))
    for block_tokens in (4 * P, 4 * 3 * P, 4 * M * P):  # one page a row per block, three, all in one
        got = decode_latent_attention(attn, x, rows, pool, new, block_tokens=block_tokens)
        np.testing.assert_allclose(np.asarray(got)[:3], np.asarray(want)[:3], atol=1e-5, rtol=0)
        assert np.all(np.isfinite(np.asarray(got)))
