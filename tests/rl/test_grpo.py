"""GRPO loss math against an independent float64 numpy loop, and its gradients against finite differences."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.config import from_config_dict, load_config_dict
from jaxmoe.model import create_model
from jaxmoe.rl.grpo import LossTerms, group_advantages, grpo_loss

TINY_CONFIG = pathlib.Path(__file__).parents[2] / "configs/tiny.py"
B, G, T = 12, 4, 13  # 3 prompts x 4 completions, 13 tokens: odd sizes so no transpose can hide


# ---------------------------------------------------------------------------------------------
# The reference: plain loops in float64, written from the formulas, not from the implementation.


def _ref_advantages(rewards, group_size, scale=True, eps=1e-4):
    rewards = np.asarray(rewards, np.float64)
    out = np.zeros_like(rewards)
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        adv = group - group.mean()
        if scale:
            adv = adv / (group.std(ddof=1) + eps)
        out[start : start + group_size] = adv
    return out


def _ref_loss(logp, old, engine, adv, mask, ref=None, eps_low=0.2, eps_high=0.28, beta=0.0, is_cap=2.0):
    logp, old, engine, adv, mask = (np.asarray(x, np.float64) for x in (logp, old, engine, adv, mask))
    ref = None if ref is None else np.asarray(ref, np.float64)
    rows, cols = logp.shape
    tokens = policy_sum = kl_weighted_sum = kl_sum = clip_low = clip_high = 0.0
    weights = []
    for b in range(rows):
        log_w = sum(old[b, t] - engine[b, t] for t in range(cols) if mask[b, t])
        w = np.exp(log_w)
        has_tokens = any(mask[b, t] for t in range(cols))
        if has_tokens:
            weights.append(w)
        weight = 0.0 if w > is_cap else w
        for t in range(cols):
            if not mask[b, t]:
                continue
            tokens += 1
            ratio = np.exp(logp[b, t] - old[b, t])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            policy_sum += weight * -min(ratio * adv[b], clipped * adv[b])
            clip_low += ratio < 1 - eps_low and adv[b] < 0
            clip_high += ratio > 1 + eps_high and adv[b] > 0
            if ref is not None:
                k3 = np.exp(ref[b, t] - logp[b, t]) - (ref[b, t] - logp[b, t]) - 1
                kl_sum += k3
                kl_weighted_sum += weight * k3
    denom = max(tokens, 1.0)
    return dict(
        loss=(policy_sum + beta * kl_weighted_sum) / denom,
        policy_loss=policy_sum / denom,
        kl=kl_sum / denom,
        clip_low_fraction=clip_low / denom,
        clip_high_fraction=clip_high / denom,
        is_ratio_mean=np.mean(weights) if weights else 0.0,
        is_ratio_max=max(weights) if weights else 0.0,
        is_masked_fraction=np.mean([w > is_cap for w in weights]) if weights else 0.0,
        tokens=tokens,
    )


# ---------------------------------------------------------------------------------------------
# Batches: random logprobs near old_logp, and variants that stress one rule each.


def _batch(seed, *, ratio_spread=0.1, engine_spread=0.02):
    rng = np.random.default_rng(seed)
    old = -rng.uniform(0.1, 4.0, (B, T))
    logp = old + rng.uniform(-ratio_spread, ratio_spread, (B, T))
    engine = old + rng.uniform(-engine_spread, engine_spread, (B, T))
    ref = old + rng.uniform(-0.3, 0.3, (B, T))
    lengths = rng.integers(3, T + 1, B)
    mask = np.arange(T)[None, :] < lengths[:, None]
    rewards = rng.integers(0, 3, B).astype(np.float64)
    return dict(logp=logp, old=old, engine=engine, ref=ref, mask=mask, rewards=rewards)


def _case(name, seed):
    d = _batch(seed)
    kw = dict(scale=True, beta=0.0, eps_low=0.2, eps_high=0.28, is_cap=2.0)
    if name == "random":
        d["ref"] = None  # no reference: kl is 0 and the loss is the policy loss
    elif name == "equal_rewards":
        d["rewards"][:G] = 1.5  # the first group carries no signal
    elif name == "truncated":
        d["mask"][:] = False
        for b, length in enumerate([T, 1, 5, 0, 9, 2, T, 7, 3, 11, 4, 6]):
            d["mask"][b, :length] = True
        d["logp"] = np.where(d["mask"], d["logp"], -np.inf)  # padding must never leak in
    elif name == "clipped":
        rng = np.random.default_rng(100 + seed)
        d["logp"] = d["old"] + rng.choice([-0.5, 0.5], (B, T))  # ratio 0.61 or 1.65: outside both sides
    elif name == "is_capped":
        d["engine"][1] = d["old"][1] - 0.3  # w = exp(0.3 * length) > 2 for every length >= 3
        d["engine"][6] = d["old"][6] - 0.5
        d["mask"][1, 3:] = False  # w = exp(0.9) ~ 2.46: just over the cap
    elif name == "kl":
        kw.update(beta=0.1)
    elif name == "unscaled":
        kw.update(scale=False, beta=0.04, eps_low=0.1, eps_high=0.1, is_cap=float("inf"))
    return d, kw


CASES = ["random", "equal_rewards", "truncated", "clipped", "is_capped", "kl", "unscaled"]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", CASES)
def test_loss_matches_numpy_loop(name, seed):
    d, kw = _case(name, seed)
    adv = group_advantages(jnp.asarray(d["rewards"], jnp.float32), G, scale=kw["scale"])
    np.testing.assert_allclose(np.asarray(adv), _ref_advantages(d["rewards"], G, kw["scale"]), rtol=1e-6, atol=1e-6)
    hyper = dict(epsilon_low=kw["eps_low"], epsilon_high=kw["eps_high"], beta=kw["beta"], is_cap=kw["is_cap"])
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    args = (f32(d["logp"]), f32(d["old"]), f32(d["engine"]), adv, jnp.asarray(d["mask"]))
    ref = None if d["ref"] is None else f32(d["ref"])
    got = jax.jit(functools.partial(grpo_loss, **hyper))(*args, ref)
    # The reference takes the float32 values the kernel saw, widened, so only arithmetic differs.
    np_args = [np.asarray(x) for x in args] + [None if ref is None else np.asarray(ref)]
    want = _ref_loss(*np_args, **{k: kw[k] for k in ("eps_low", "eps_high", "beta", "is_cap")})
    assert isinstance(got, LossTerms)
    for field in LossTerms._fields:
        value = getattr(got, field)
        assert value.shape == () and value.dtype == jnp.float32, field
        np.testing.assert_allclose(float(value), want[field], rtol=1e-6, atol=1e-6, err_msg=field)
    assert np.isfinite(float(got.loss))


def test_case_features_are_exercised():
    """Each special case really hits its rule (else the comparison above would prove little)."""
    run = {}
    for name in CASES:
        d, kw = _case(name, 0)
        adv = group_advantages(jnp.asarray(d["rewards"], jnp.float32), G, scale=kw["scale"])
        hyper = dict(epsilon_low=kw["eps_low"], epsilon_high=kw["eps_high"], beta=kw["beta"], is_cap=kw["is_cap"])
        run[name] = (adv, grpo_loss(d["logp"], d["old"], d["engine"], adv, d["mask"], d["ref"], **hyper))
    adv, _ = run["equal_rewards"]
    assert np.all(np.asarray(adv[:G]) == 0.0)
    _, terms = run["clipped"]
    assert float(terms.clip_low_fraction) > 0.1 and float(terms.clip_high_fraction) > 0.1
    _, terms = run["is_capped"]
    assert float(terms.is_masked_fraction) == pytest.approx(2 / B) and float(terms.is_ratio_max) > 2.0
    _, terms = run["truncated"]
    assert float(terms.tokens) == T + 1 + 5 + 0 + 9 + 2 + T + 7 + 3 + 11 + 4 + 6
    _, terms = run["kl"]
    assert float(terms.kl) > 0 and float(terms.loss) != float(terms.policy_loss)
    _, terms = run["random"]
    assert float(terms.kl) == 0.0 and float(terms.loss) == float(terms.policy_loss)


def test_dropped_rows_contribute_nothing():
    """Rows with zero advantage, no tokens, or an IS weight over the cap leave the policy loss unchanged."""
    d, _ = _case("kl", 3)
    adv = np.array(group_advantages(d["rewards"], G))
    adv[:G] = 0.0
    d["mask"][G] = False
    d["engine"][G + 1] = d["old"][G + 1] - 1.0  # w >= exp(3) > cap
    terms = grpo_loss(d["logp"], d["old"], d["engine"], adv, d["mask"], d["ref"], beta=0.1)
    assert float(terms.is_masked_fraction) == pytest.approx(1 / (B - 1))  # the empty row is not counted
    rng = np.random.default_rng(7)
    dropped = [*range(G), G, G + 1]
    logp = d["logp"].copy()
    logp[dropped] += rng.normal(size=(len(dropped), T))  # change everything the rules say is ignored
    adv2 = adv.copy()
    adv2[G : G + 2] = rng.normal(size=2)
    again = grpo_loss(logp, d["old"], d["engine"], adv2, d["mask"], d["ref"], beta=0.1)
    # Zero-advantage rows keep their KL term (only their policy term is 0): compare the policy part.
    np.testing.assert_allclose(float(again.policy_loss), float(terms.policy_loss), rtol=1e-6, atol=1e-7)
    assert float(again.tokens) == float(terms.tokens)


# ---------------------------------------------------------------------------------------------
# group_advantages and argument checks.


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("group_size", [2, 5, 7])
@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_numpy(seed, group_size, scale):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=3 * group_size).astype(np.float32)
    rewards[:group_size] = 0.1  # an all-equal group: exactly 0, whatever float rounding does
    rewards[group_size : 2 * group_size] = rng.integers(0, 2, group_size)
    got = np.asarray(group_advantages(jnp.asarray(rewards), group_size, scale=scale))
    np.testing.assert_allclose(got, _ref_advantages(rewards, group_size, scale), rtol=1e-6, atol=1e-6)
    assert np.all(got[:group_size] == 0.0)
    assert got.dtype == np.float32


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(jnp.ones(4), 1)
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages(jnp.ones(8), 3)
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(jnp.ones((2, 4)), 2)


def test_grpo_loss_errors():
    x, adv, mask = jnp.zeros((3, 5)), jnp.zeros(3), jnp.ones((3, 5), bool)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(x, x, x, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="logp must be"):
        grpo_loss(jnp.zeros(5), x, x, adv, mask)
    for i, name in enumerate(["old_logp", "engine_logp"]):
        args = [x, x, x, adv, mask]
        args[1 + i] = jnp.zeros((3, 4))
        with pytest.raises(ValueError, match=name):
            grpo_loss(*args)
    with pytest.raises(ValueError, match="mask"):
        grpo_loss(x, x, x, adv, jnp.ones((2, 5)))
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(x, x, x, adv, mask, jnp.zeros((3, 6)), beta=0.1)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(x, x, x, jnp.zeros((3, 1)), mask)
    for kw, name in [
        (dict(epsilon_low=1.0), "epsilon_low"),
        (dict(epsilon_low=-0.1), "epsilon_low"),
        (dict(epsilon_high=-0.1), "epsilon_high"),
        (dict(beta=-1.0), "beta"),
        (dict(is_cap=0.0), "is_cap"),
        (dict(is_cap=float("nan")), "is_cap"),
    ]:
        with pytest.raises(ValueError, match=name):
            grpo_loss(x, x, x, adv, mask, x, **kw)


# ---------------------------------------------------------------------------------------------
# Gradients: d loss / d logp in float64, and d loss / d params through the tiny model in float32.


@pytest.mark.parametrize("name", ["equal_rewards", "truncated", "clipped", "is_capped", "kl"])
def test_logp_gradient_matches_finite_differences(name):
    d, kw = _case(name, 0)
    d["logp"] = np.where(d["mask"], d["logp"], -3.0)  # finite off the mask: differences stay defined
    hyper = dict(epsilon_low=kw["eps_low"], epsilon_high=kw["eps_high"], beta=kw["beta"] or 0.1, is_cap=kw["is_cap"])
    with jax.enable_x64(True):
        adv = group_advantages(jnp.asarray(d["rewards"]), G)
        rest = (jnp.asarray(d["old"]), jnp.asarray(d["engine"]), adv, jnp.asarray(d["mask"]), jnp.asarray(d["ref"]))
        loss = jax.jit(lambda logp: grpo_loss(logp, *rest, **hyper).loss)
        logp = jnp.asarray(d["logp"])
        assert logp.dtype == jnp.float64 and loss(logp).dtype == jnp.float64
        grad = np.asarray(jax.grad(loss)(logp))
        h = 1e-6
        eye = np.eye(B * T).reshape(B * T, B, T) * h
        fd = np.array([(loss(logp + e) - loss(logp - e)) / (2 * h) for e in eye]).reshape(B, T)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)
    assert np.all(grad[~d["mask"]] == 0.0)
    assert np.abs(grad).max() > 1e-3


def test_model_gradient_matches_finite_differences():
    """d loss / d (a few parameter entries) of the tiny model: autodiff against central differences."""
    cfg = from_config_dict(load_config_dict(TINY_CONFIG))
    model = create_model(cfg.model, seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(0)
    batch, length, prompt = 4, 11, 4
    tokens = jnp.asarray(rng.integers(0, cfg.model.vocab_size, (batch, length)), jnp.int32)
    mask = np.zeros((batch, length - 1), bool)  # completion tokens are targets at positions >= prompt
    for b, stop in enumerate([length - 1, 7, 9, 5]):
        mask[b, prompt - 1 : stop] = True

    def logprobs(params):
        logits = nnx.merge(graphdef, params, rest)(tokens)[:, :-1]  # [B, T-1, V]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]

    adv = jnp.asarray([1.0, -0.5, 0.8, -1.2])

    @jax.jit  # one compiled program for everything below: the model's compile dominates the test
    def loss_and_grad(params, old, engine, ref):
        def loss(params):
            logp = logprobs(params)
            return grpo_loss(logp, old, engine, adv, mask, ref, beta=0.1, is_cap=float("inf")).loss, logp

        return jax.value_and_grad(loss, has_aux=True)(params)

    zeros = jnp.zeros(mask.shape)
    (_, logp0), _ = loss_and_grad(params, zeros, zeros, zeros)
    logp0 = np.asarray(logp0)
    # Old logprobs off by +-0.1 (ratio inside the clip range) or +-0.5 (outside, both sides): both
    # branches of the min carry gradient, and a step of h moves no ratio across a clip boundary.
    old = logp0 + rng.choice([-0.5, -0.1, 0.1, 0.5], logp0.shape)
    engine, ref = old - 0.01, logp0 + rng.uniform(-0.2, 0.2, logp0.shape)
    (value, _), grads = loss_and_grad(params, old, engine, ref)
    assert np.isfinite(float(value))
    flat_params, treedef = jax.tree.flatten(params)
    flat_grads = jax.tree.leaves(grads)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.flatten_with_path(params)[0]]
    checked = 0
    for needle in ("embed", "lm_head", "final_norm", "layers"):
        i = next(i for i, p in enumerate(paths) if needle in p)
        g = np.asarray(flat_grads[i]).ravel()
        j = int(np.argmax(np.abs(g)))  # the largest entry: a gradient well above float32 noise
        h = 1e-3

        def shifted(step, i=i, j=j):
            leaves = list(flat_params)
            leaves[i] = leaves[i].reshape(-1).at[j].add(step).reshape(leaves[i].shape)
            return float(loss_and_grad(jax.tree.unflatten(treedef, leaves), old, engine, ref)[0][0])

        fd = (shifted(h) - shifted(-h)) / (2 * h)
        # float32: each loss (~0.4) is known to a few 1e-8 (more with the forward's own rounding), so
        # the difference over 2h = 2e-3 carries up to ~1e-4 absolute noise; O(h^2) curvature is far below.
        assert abs(g[j]) > 1e-3, paths[i]
        np.testing.assert_allclose(fd, g[j], rtol=1e-3, atol=3e-4, err_msg=paths[i])
        checked += 1
    assert checked == 4
