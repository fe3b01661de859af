"""The tiny hybrid model under jit on the 8-device CPU mesh equals the single-device model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from model_helpers import TINY_CONFIG, assert_same_loss_and_grads, loss_and_grads

from jaxmoe.config import load_config
from jaxmoe.model import create_model, shard_model
from jaxmoe.sharding import logical_to_spec

TOL = 1e-5


@pytest.fixture(scope="module")
def cfg():
    return load_config(TINY_CONFIG)


def _batch(cfg, seq=40):
    # seq > indexer top-k (32) so DSA selection is exercised; > KDA chunk (16), not a multiple.
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (8, seq + 1), dtype=np.int32)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.fixture(scope="module")
def single_device(cfg):
    model = create_model(cfg.model, seed=0)
    inputs, targets = _batch(cfg)
    loss, grads = loss_and_grads(model, inputs, targets)
    return model, loss, grads


def test_sharded_equals_single_device(cfg, mesh, single_device):
    model0, loss0, grads0 = single_device
    model = create_model(cfg.model, seed=0, mesh=mesh)
    # Built in its sharded layout from the same seed: the same parameters (XLA's partitioned
    # random-normal may differ from the eager one in the last float32 bit, ~1e-8 here).
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7),
        nnx.to_pure_dict(nnx.state(model0)),
        nnx.to_pure_dict(nnx.state(model)),
    )
    # Parameters carry the rules' shardings.
    layer = model.layers[1]  # kda + MoE
    assert layer.ffn.w_gate[...].sharding.spec == logical_to_spec(("experts", "embed", "expert_ffw"))
    assert model.embed[...].sharding.spec == logical_to_spec(("vocab", "embed"))
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if sizes["tensor"] > 1:
        assert not model.lm_head[...].sharding.is_fully_replicated

    # Numerics on the exact single-device parameters, placed on the mesh by the rules.
    model = shard_model(model0, mesh)
    inputs, targets = _batch(cfg)
    batch_sharding = NamedSharding(mesh, logical_to_spec(("batch", "seq")))
    inputs, targets = jax.device_put(inputs, batch_sharding), jax.device_put(targets, batch_sharding)
    loss, grads = loss_and_grads(model, inputs, targets)
    assert_same_loss_and_grads(loss, grads, loss0, grads0, atol=TOL)


def test_shard_model_places_by_rules(cfg, mesh, single_device):
    model0, *_ = single_device
    model = shard_model(model0, mesh)
    spec = model.layers[0].attn.kv_b[...].sharding.spec
    assert spec == logical_to_spec(("kv_lora", "heads", "head_dim"))


def test_logits_shape_and_dtype(cfg, single_device):
    model, *_ = single_device
    inputs, _ = _batch(cfg, seq=5)
    logits = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(inputs))
    assert logits.shape == (8, 5, cfg.model.vocab_size) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()


def test_abstract_model_matches_eval_shape(cfg):
    """The no-trace abstract construction equals nnx.eval_shape of the real constructor."""
    from jaxmoe.model import Transformer, abstract_model

    fast = nnx.state(abstract_model(cfg.model))
    slow = nnx.state(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    fast_leaves, fast_def = jax.tree.flatten(fast, is_leaf=is_var)
    slow_leaves, slow_def = jax.tree.flatten(slow, is_leaf=is_var)
    assert fast_def == slow_def
    for a, b in zip(fast_leaves, slow_leaves):
        assert type(a) is type(b)
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        assert a.get_metadata()["axes"] == b.get_metadata()["axes"]
