"""The train step: losses, gradients, optimizer update and the MoE bias update, jit-compiled over the mesh.

State (:class:`TrainState`): the model's fp32 master parameters (``nnx.Param``; compute runs in
``model.dtype``, so ``dtype="bfloat16", param_dtype="float32"`` is bf16 compute with fp32 master
weights), the MoE router biases (``RouterBias``, not trained by the optimizer), the model
optimizer's state and, when the DSA dense warm-up is configured, the indexer optimizer's state.
All are pure dicts (``nnx.to_pure_dict`` layout), sharded by the rules of :mod:`jaxmoe.sharding`.

Two stages (DeepSeek-V3.2, section 2.1.1):

- ``warmup`` (the first ``dsa.warmup_steps`` steps): DSA layers attend densely (MLA); the loss is
  the sum over DSA layers of the indexer KL to the dense attention; only the indexer parameters
  are differentiated and updated, by their own optimizer; everything else, the router bias
  included, stays bitwise unchanged.
- ``main``: sparse DSA; all parameters train on ``LM + seq_aux_loss_weight * seq_aux +
  indexer_loss_weight * sum KL``. The KL's inputs are detached, so it trains only the indexer and
  the LM loss trains everything else. After the optimizer update each MoE layer's router bias
  moves by ``bias_rate * sign(mean load - load_e)`` from the step's own per-expert load.

Shape letters: B batch, T sequence, V vocab, E experts, K experts per token, L MoE layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.attention.dsa import DSA
from jaxmoe.config import Config, TrainConfig
from jaxmoe.layer_plan import stack_layers, unstack_layers
from jaxmoe.model import abstract_model, create_model, layer_plan
from jaxmoe.moe.router import RouterBias
from jaxmoe.sharding import logical_to_spec, state_shardings
from jaxmoe.train.optim import indexer_warmup_optimizer, learning_rate, model_optimizer
from jaxmoe.vision.layout import VisionInputs

STAGES = ("warmup", "main")


class TrainState(NamedTuple):
    """Everything a step reads and writes (a pytree of pure dicts)."""

    params: dict  # nnx.Param values, master dtype
    router_bias: dict  # RouterBias values ({} without MoE layers)
    opt_state: Any  # the model optimizer's state over params
    indexer_opt_state: Any  # the warm-up optimizer's state over the indexer params (None: no warm-up)


# --------------------------------------------------------------------------------------------
# Pure-dict helpers


def _is_indexer(path: tuple) -> bool:
    return "indexer" in path


def select(tree: dict, pred: Callable[[tuple], bool], path: tuple = ()) -> dict:
    """The sub-dict of ``tree`` whose leaf paths satisfy ``pred`` (empty branches dropped)."""
    out = {}
    for k, v in tree.items():
        p = (*path, k)
        if isinstance(v, dict):
            sub = select(v, pred, p)
            if sub:
                out[k] = sub
        elif pred(p):
            out[k] = v
    return out


def merge_into(tree: dict, sub: dict) -> dict:
    """``tree`` with the leaves present in ``sub`` replaced."""
    out = dict(tree)
    for k, v in sub.items():
        out[k] = merge_into(tree[k], v) if isinstance(v, dict) else v
    return out


def deep_merge(a: dict, b: dict) -> dict:
    """Union of two dicts with disjoint leaves (e.g. params and router biases -> the model state)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if k in out and isinstance(v, dict) else v
    return out


# --------------------------------------------------------------------------------------------
# Losses


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of ``logits[B, T, V]`` (fp32) against ``targets[B, T]``."""
    # optax picks each target's logit by index: no [B, T, V] one-hot is built.
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets))


def masked_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """The cross-entropy's mean over the positions where ``mask[B, T]`` is 1 (0 when none is)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = mask.astype(jnp.float32)
    return (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def update_router_bias(router_bias: dict, loads: dict[int, jax.Array], rate: float, plan=None) -> dict:
    """``bias_e += rate * sign(mean load - load_e)`` for every MoE layer (loads ``[E]`` per layer).

    ``plan``: the biases are in the stacked layout of this layer plan (``None``: per layer).
    """
    out = unstack_layers(router_bias, plan) if plan is not None else router_bias
    for i, load in loads.items():
        bias = out["layers"][i]["ffn"]["router_bias"]
        load = load.astype(jnp.float32)
        new = bias + rate * jnp.sign(jnp.mean(load) - load)
        out = merge_into(out, {"layers": {i: {"ffn": {"router_bias": new.astype(bias.dtype)}}}})
    return stack_layers(out, plan) if plan is not None else out


class Forward(NamedTuple):
    lm_loss: jax.Array  # [] fp32
    indexer_kl: jax.Array  # [] fp32, summed over DSA layers (0 without)
    seq_aux: jax.Array  # [] fp32, summed over MoE layers (0 without)
    expert_load: dict  # layer index -> [E] int32
    drop_fraction: dict  # layer index -> [] fp32


def set_dense_dsa(model: nnx.Module, dense: bool) -> None:
    """Switches every DSA layer of ``model`` to dense (warm-up) or sparse attention."""
    for _, module in nnx.iter_graph(model):
        if isinstance(module, DSA):
            module.dense_attention = dense


def forward(
    graphdef,
    params: dict,
    router_bias: dict,
    inputs: jax.Array,
    targets: jax.Array,
    *,
    cfg: Config,
    stage: str,
    remat: bool = False,
    mask: jax.Array | None = None,
    images: VisionInputs | None = None,
) -> Forward:
    """The model on ``inputs[B, T]`` and every loss term and routing statistic of the step.

    ``mask [B, T]``: the LM loss is over the positions where it is 1 only (all positions without);
    ``images``: the image inputs of the placeholders in ``inputs`` (a model with a vision tower).
    """
    model = nnx.merge(graphdef, params, router_bias)
    set_dense_dsa(model, stage == "warmup")
    call = lambda m, x: m(x, images=images, remat=remat)
    logits, inter = nnx.capture(call, nnx.Intermediate)(model, inputs)
    lm_loss = cross_entropy(logits, targets) if mask is None else masked_cross_entropy(logits, targets, mask)
    inter = nnx.to_pure_dict(inter)
    if model.scan:  # sown stacked over each stack's repetitions: per layer again
        inter = unstack_layers(inter, layer_plan(cfg.model))
    layers = inter.get("layers", {})
    zero = jnp.zeros((), jnp.float32)
    indexer_kl, seq_aux, loads, drops = zero, zero, {}, {}
    for i in range(cfg.model.num_layers):
        sown = layers.get(i, {})
        if "indexer_kl" in sown:
            indexer_kl += sown["indexer_kl"][0]
        if "seq_aux" in sown:
            seq_aux += sown["seq_aux"][0]
            stats = sown["ffn"]["moe_stats"][0]
            loads[i], drops[i] = stats.expert_load, stats.drop_fraction
    return Forward(lm_loss, indexer_kl, seq_aux, loads, drops)


# --------------------------------------------------------------------------------------------
# Steps: module-level functions of (graphdef, program config, stage), so every Trainer of the same
# program shares one compiled executable per process (jax.jit caches on the function and its
# static arguments).


def split_steps(cfg: Config) -> tuple[int, int]:
    """``(warm-up steps, main steps)``: the DSA dense warm-up needs DSA layers."""
    warmup = min(cfg.train.dsa.warmup_steps, cfg.train.steps) if "dsa" in cfg.model.layer_kinds else 0
    return warmup, cfg.train.steps - warmup


def optimizers(cfg: Config) -> tuple[optax.GradientTransformation, optax.GradientTransformation | None]:
    """The model optimizer (over the main steps) and the warm-up's indexer optimizer (None without one)."""
    warmup, main = split_steps(cfg)
    tx = model_optimizer(cfg.train.optim, max(main, 1))
    indexer_tx = indexer_warmup_optimizer(cfg.train.optim, cfg.train.dsa.warmup_learning_rate) if warmup else None
    return tx, indexer_tx


def program_config(cfg: Config) -> Config:
    """``cfg`` with the fields that do not enter the compiled step reset (name, seed, data, logging...)."""
    t, d = cfg.train, TrainConfig()
    kept = dataclasses.replace(
        d,
        steps=t.steps,
        batch_size=t.batch_size,
        seq_len=t.seq_len,
        remat=t.remat,
        scan_layers=t.scan_layers,
        optim=t.optim,
        moe_balance=t.moe_balance,
        dsa=t.dsa,
    )
    return dataclasses.replace(cfg, name="", train=kept)


def _metrics(out: Forward, total: jax.Array, grad_norm: jax.Array) -> dict:
    return {
        "loss": out.lm_loss,
        "total_loss": total,
        "indexer_kl": out.indexer_kl,
        "seq_aux_loss": out.seq_aux,
        "grad_norm": grad_norm,
        "expert_load": out.expert_load,
        "drop_fraction": out.drop_fraction,
    }


def train_step(
    graphdef, cfg: Config, stage: str, state: TrainState, inputs, targets, mask=None, images=None
) -> tuple[TrainState, dict]:
    """One update of ``stage`` on ``inputs, targets [B, T]``: ``(new state, metrics)``.

    ``mask`` and ``images`` as in :func:`forward` (an image-text batch, the loss on its answers).
    """
    t = cfg.train
    tx, indexer_tx = optimizers(cfg)
    run = lambda params: forward(
        graphdef, params, state.router_bias, inputs, targets, cfg=cfg, stage=stage, remat=t.remat, mask=mask,
        images=images,
    )  # fmt: skip
    if stage == "warmup":
        indexer_params = select(state.params, _is_indexer)

        def indexer_loss(indexer_params):
            out = run(merge_into(state.params, indexer_params))
            return out.indexer_kl, out

        (total, out), grads = jax.value_and_grad(indexer_loss, has_aux=True)(indexer_params)
        updates, indexer_opt = indexer_tx.update(grads, state.indexer_opt_state, indexer_params)
        params = merge_into(state.params, optax.apply_updates(indexer_params, updates))
        new = TrainState(params, state.router_bias, state.opt_state, indexer_opt)
        return new, _metrics(out, total, optax.global_norm(grads))

    def loss(params):
        out = run(params)
        total = out.lm_loss
        if t.moe_balance.seq_aux_loss_weight:
            total = total + t.moe_balance.seq_aux_loss_weight * out.seq_aux
        if t.dsa.indexer_loss_weight:
            total = total + t.dsa.indexer_loss_weight * out.indexer_kl
        return total, out

    (total, out), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
    updates, opt = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    bias = state.router_bias
    if t.moe_balance.bias_rate:
        plan = layer_plan(cfg.model) if t.scan_layers else None
        bias = update_router_bias(bias, out.expert_load, t.moe_balance.bias_rate, plan)
    new = TrainState(params, bias, opt, state.indexer_opt_state)
    return new, _metrics(out, total, optax.global_norm(grads))


def eval_loss(graphdef, cfg: Config, stage: str, state: TrainState, inputs, targets) -> jax.Array:
    """The LM loss of ``state`` on ``inputs, targets`` with ``stage``'s attention (dense DSA in the warm-up)."""
    model = nnx.merge(graphdef, state.params, state.router_bias)
    set_dense_dsa(model, stage == "warmup")
    return cross_entropy(model(inputs), targets)


# --------------------------------------------------------------------------------------------
# The trainer: state layout, shardings, jitted steps


class Trainer:
    """The train state and jit-compiled steps of ``cfg`` on ``mesh``.

    Args:
        cfg: the validated config (``cfg.train`` holds the training fields).
        mesh: the device mesh; calls must run under ``jax.set_mesh(mesh)``.
    """

    def __init__(self, cfg: Config, mesh: jax.sharding.Mesh):
        self.cfg, self.mesh = cfg, mesh
        self.program = program_config(cfg)
        self.warmup_steps, self.main_steps = split_steps(cfg)
        self.tx, self.indexer_tx = optimizers(cfg)
        graphdef, params, bias = nnx.split(abstract_model(cfg.model, scan=cfg.train.scan_layers), nnx.Param, RouterBias)
        self.graphdef = graphdef
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.batch_sharding = NamedSharding(mesh, logical_to_spec(("batch", "seq")))
        param_shardings = nnx.to_pure_dict(state_shardings(params, mesh))
        bias_shardings = nnx.to_pure_dict(state_shardings(bias, mesh))
        abstract_params = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nnx.to_pure_dict(params), param_shardings
        )
        opt_shardings = self._opt_shardings(self.tx, abstract_params, param_shardings)
        indexer_shardings = None
        if self.indexer_tx is not None:
            indexer_shardings = self._opt_shardings(
                self.indexer_tx, select(abstract_params, _is_indexer), select(param_shardings, _is_indexer)
            )
        self.state_shardings = TrainState(param_shardings, bias_shardings, opt_shardings, indexer_shardings)
        self._abstract_params, self._abstract_bias = abstract_params, bias

    def _opt_shardings(self, tx, abstract_params, param_shardings):
        abstract_opt = jax.eval_shape(tx.init, abstract_params)
        return optax.tree_utils.tree_map_params(
            tx, lambda _, s: s, abstract_opt, param_shardings, transform_non_params=lambda _: self.replicated
        )

    # --- state ---------------------------------------------------------------------------------
    def init_state(self, seed: int) -> TrainState:
        """Fresh parameters (``create_model(seed)``, sharded at creation) and optimizer states."""
        model = create_model(self.cfg.model, seed=seed, mesh=self.mesh, scan=self.cfg.train.scan_layers)
        _, params, bias = nnx.split(model, nnx.Param, RouterBias)
        params, bias = nnx.to_pure_dict(params), nnx.to_pure_dict(bias)
        opt = jax.jit(self.tx.init, out_shardings=self.state_shardings.opt_state)(params)
        indexer_opt = None
        if self.indexer_tx is not None:
            indexer_opt = jax.jit(self.indexer_tx.init, out_shardings=self.state_shardings.indexer_opt_state)(
                select(params, _is_indexer)
            )
        return TrainState(params, bias, opt, indexer_opt)

    def abstract_state(self) -> TrainState:
        """``ShapeDtypeStruct``s with shardings of the state: the restore target."""
        params = self._abstract_params
        bias = nnx.to_pure_dict(self._abstract_bias)
        indexer_opt = None
        if self.indexer_tx is not None:
            indexer_opt = jax.eval_shape(self.indexer_tx.init, select(params, _is_indexer))
        shapes = TrainState(params, bias, jax.eval_shape(self.tx.init, params), indexer_opt)
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, self.state_shardings
        )

    def stage(self, step: int) -> str:
        """The stage of the step that follows ``step`` completed steps."""
        return "warmup" if step < self.warmup_steps else "main"

    def learning_rate(self, step: int) -> float:
        """The rate the update after ``step`` completed steps uses."""
        if step < self.warmup_steps:
            return float(self.cfg.train.dsa.warmup_learning_rate)
        return float(learning_rate(self.cfg.train.optim, max(self.main_steps, 1))(step - self.warmup_steps))

    def batch(self, tokens) -> tuple[jax.Array, jax.Array]:
        """A host batch ``[B, T + 1]`` (the same on every process) -> global ``inputs, targets [B, T]``."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        make = lambda a: jax.make_array_from_callback(a.shape, self.batch_sharding, lambda idx: a[idx])
        return make(inputs), make(targets)

    # --- steps ---------------------------------------------------------------------------------
    def _jit_step(self, stage: str):
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        return jax.jit(
            train_step,
            static_argnums=(0, 1, 2),
            in_shardings=(self.state_shardings, self.batch_sharding, self.batch_sharding),
            out_shardings=(self.state_shardings, self.replicated),
            donate_argnums=3,
        )

    def image_step_fn(self, stage: str) -> Callable[..., tuple[TrainState, dict]]:
        """The jitted ``(state, inputs, targets, mask, images) -> (state, metrics)`` of an image-text
        batch (:func:`train_step` with a loss mask and :class:`VisionInputs`; the state is donated)."""
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        step = jax.jit(
            train_step,
            static_argnums=(0, 1, 2),
            in_shardings=(self.state_shardings, *[self.batch_sharding] * 3, self.replicated),
            out_shardings=(self.state_shardings, self.replicated),
            donate_argnums=3,
        )
        return lambda state, *batch: step(self.graphdef, self.program, stage, state, *batch)

    def step_fn(self, stage: str) -> Callable[[TrainState, jax.Array, jax.Array], tuple[TrainState, dict]]:
        """The jitted ``(state, inputs, targets) -> (state, metrics)`` of ``stage`` (the state is donated)."""
        step = self._jit_step(stage)
        return lambda state, inputs, targets: step(self.graphdef, self.program, stage, state, inputs, targets)

    def compile_step(self, stage: str, state: TrainState, inputs, targets):
        """:meth:`step_fn` compiled ahead of time (to time it); called the same way."""
        return self.lower("train", stage, state, inputs, targets).compile()

    def _jit_eval(self):
        return jax.jit(
            eval_loss,
            static_argnums=(0, 1, 2),
            in_shardings=(self.state_shardings, self.batch_sharding, self.batch_sharding),
            out_shardings=self.replicated,
        )

    def lower(self, step: str, stage: str, state: TrainState, inputs, targets) -> jax.stages.Lowered:
        """The ``"train"`` step (:meth:`step_fn`) or the ``"forward"`` loss (:meth:`eval_fn`) lowered for
        these arguments (arrays or ``ShapeDtypeStruct``s with shardings: an ahead-of-time compile)."""
        jitted = self._jit_step(stage) if step == "train" else self._jit_eval()
        return jitted.lower(self.graphdef, self.program, stage, state, inputs, targets)

    def eval_fn(self, stage: str) -> Callable[[TrainState, jax.Array, jax.Array], jax.Array]:
        """The jitted held-out LM loss ``(state, inputs, targets) -> []`` with ``stage``'s attention."""
        loss = self._jit_eval()
        return lambda state, inputs, targets: loss(self.graphdef, self.program, stage, state, inputs, targets)
