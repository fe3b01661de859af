"""The whole tiny model under context parallelism equals the model without a mesh.

Loss and gradients of every parameter (fp32, 1e-5) on meshes with the sequence split over
``context`` (8; 2 data x 4 context; 2 expert x 4 context) against the single-device run. The
per-layer context-parallel tests are in ``tests/attention/test_context_parallel.py``.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from model_helpers import TINY_CONFIG, assert_same_loss_and_grads, loss_and_grads

from jaxmoe.config import MeshConfig, load_config
from jaxmoe.model import create_model, shard_model
from jaxmoe.sharding import logical_to_spec, make_mesh

TOL = 1e-5

MODEL_MESHES = {
    "context8": MeshConfig(context=8),
    "data2_context4": MeshConfig(data=2, context=4),
    "expert2_context4": MeshConfig(expert=2, context=4),
}


TINY_KINDS = ("mla", "kda", "dsa", "kda")  # the tiny config's own kinds: every attention kind


@functools.cache
def _tiny_model_reference():
    """The tiny hybrid model (attention + MoE) and its loss and gradients without a mesh."""
    cfg = load_config(TINY_CONFIG).model
    cfg = dataclasses.replace(cfg, layer_kinds=TINY_KINDS)
    model = create_model(cfg, seed=0)
    # 48 tokens: a multiple of 2 x 8 (zig-zag) and 6 a shard on 8 shards (>= conv K-1 = 3);
    # KDA chunks (16) do not line up with the shards (12 or 6 tokens), so boundary states matter.
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 49), dtype=np.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    return model, inputs, targets, loss_and_grads(model, inputs, targets)


@pytest.mark.parametrize("name", sorted(MODEL_MESHES))
def test_tiny_model_context_parallel_equals_single_device(name):
    model0, inputs, targets, (loss0, grads0) = _tiny_model_reference()
    mesh = make_mesh(MODEL_MESHES[name])
    with jax.set_mesh(mesh):
        model = shard_model(model0, mesh)
        batch = NamedSharding(mesh, logical_to_spec(("batch", "seq")))
        loss, grads = loss_and_grads(model, jax.device_put(inputs, batch), jax.device_put(targets, batch))
    assert_same_loss_and_grads(loss, grads, loss0, grads0, atol=TOL)
