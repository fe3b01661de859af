"""Per-device activation memory of a whole-model forward falls with the ``context`` axis size P.

Compile only: XLA's memory analysis (``.lower(...).compile().memory_analysis()``) of the tiny
model (every attention kind and the MoE) over 32,768 tokens, batch 1, on meshes of exactly P
devices, all on ``context``. From P=2 to P=8 the temporary bytes per device should fall about 4x;
a computation that GSPMD leaves unsplit along the tokens (``top_k`` in the router or the sort by
expert: XLA gathers their operands whole onto every device) held the ratio to 1.8. A second test
looks for such gathered arrays directly in the compiled MoE, forward and backward, for each
dispatch path that runs on CPU.
"""

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import MeshConfig, load_config
from jaxmoe.model import abstract_model
from jaxmoe.moe import MoE
from jaxmoe.sharding import make_mesh, state_shardings

CONFIG = pathlib.Path(__file__).parents[1] / "configs/tiny.py"
TOKENS = 32768
# Ideal 4; measured 3.86. The rest is P-independent: fixed-size blocks such as MLA's [heads, 512, 512]
# score block (4 MB), which at 8,192 tokens is a quarter of the P=8 total (ratio 2.2 there, with
# every token-sized array shrinking as 1/P). With the router and the expert sort replicated, 1.81.
MIN_RATIO = 3.2


def _placed(abstract: nnx.State, mesh) -> dict:
    """``jax.ShapeDtypeStruct`` leaves carrying the rules' shardings: what ``jit`` needs to compile."""
    shardings = nnx.to_pure_dict(state_shardings(abstract, mesh))
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nnx.to_pure_dict(abstract), shardings
    )


def _temp_bytes_per_device(cfg, p: int) -> int:
    mesh = make_mesh(MeshConfig(context=p), devices=jax.devices()[:p])
    with jax.set_mesh(mesh):
        graphdef, abstract = nnx.split(abstract_model(cfg))  # shapes only: nothing is initialised
        state = _placed(abstract, mesh)
        forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, nnx.State(state))(tokens))  # [1, T, V]
        sharding = NamedSharding(mesh, PartitionSpec(None, "context"))
        tokens = jax.ShapeDtypeStruct((1, TOKENS), jnp.int32, sharding=sharding)
        return forward.lower(state, tokens).compile().memory_analysis().temp_size_in_bytes


def test_temp_memory_falls_with_context_size():
    cfg = dataclasses.replace(load_config(CONFIG).model, max_context=TOKENS)
    assert set(cfg.layer_kinds) == {"mla", "dsa", "kda"} and cfg.moe.first_k_dense < cfg.num_layers
    p2, p8 = _temp_bytes_per_device(cfg, 2), _temp_bytes_per_device(cfg, 8)
    assert p2 / p8 >= MIN_RATIO, f"temp bytes per device: P=2 {p2}, P=8 {p8}, ratio {p2 / p8:.2f} < {MIN_RATIO}"


@pytest.mark.parametrize("dispatch", ["dense", "dropless", "capacity"])
def test_moe_keeps_tokens_split(dispatch):
    """No array in the compiled MoE forward and backward on 8 context shards spans more tokens than a shard holds."""
    cfg = load_config(CONFIG).model
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dispatch=dispatch))
    # A shard holds T/P = 1024 tokens, K T/P = 2048 assignments, 1.25x that in capacity slots;
    # a gather over `context` makes 8192 rows or more.
    T, P = 8192, 8
    mesh = make_mesh(MeshConfig(context=P))
    with jax.set_mesh(mesh):
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: MoE(cfg, rngs=nnx.Rngs(0))))
        state = _placed(abstract, mesh)
        x = jax.ShapeDtypeStruct(
            (1, T, cfg.d_model), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(None, "context"))
        )

        def loss(state, x):
            return jnp.sum(nnx.merge(graphdef, nnx.State(state))(x) ** 2)

        hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).compile().as_text()
    dims = [int(d) for shape in re.findall(r"\b(?:f32|s32|u32|pred|bf16)\[([\d,]+)\]", hlo) for d in shape.split(",")]
    assert dims and max(dims) < T // 2, f"an array of {max(dims)} rows: tokens gathered across context shards"
