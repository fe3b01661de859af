"""Forward pass of a config's model on its mesh (XLA's fake CPU devices), as one JSON line.

python launch/tiny_forward.py --config configs/tiny.py [--batch 8] [--seq 128]
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmoe.config import load_config
from jaxmoe.model import create_model
from jaxmoe.sharding import logical_to_spec, make_mesh


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args()
    cfg = load_config(args.config)
    mesh = make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        model = create_model(cfg.model, seed=0, mesh=mesh)
        graphdef, state = nnx.split(model)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, cfg.model.vocab_size, (args.batch, args.seq + 1), dtype=np.int32)
        sharding = jax.sharding.NamedSharding(mesh, logical_to_spec(("batch", "seq")))
        inputs = jax.device_put(tokens[:, :-1], sharding)
        targets = jax.device_put(tokens[:, 1:], sharding)

        @jax.jit
        def loss_fn(state, inputs, targets):
            logits = nnx.merge(graphdef, state)(inputs)
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

        t0 = time.perf_counter()
        loss = float(loss_fn(state, inputs, targets))
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        loss = float(loss_fn(state, inputs, targets))
        step_s = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "config": cfg.name,
                "mesh": dict(zip(mesh.axis_names, mesh.axis_sizes)),
                "tokens": args.batch * args.seq,
                "loss": round(loss, 4),
                "ln_vocab": round(float(np.log(cfg.model.vocab_size)), 4),
                "compile_s": round(compile_s, 2),
                "forward_s": round(step_s, 4),
                "tokens_per_s": round(args.batch * args.seq / step_s, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
