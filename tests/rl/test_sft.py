"""The RL cold start: demonstrations of every domain (scored by the domains' own verifiers as a
parsed turn), the packed batch, and the loss against a numpy log-softmax on the shared tiny run."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from tiny_run import OVERRIDES

from jaxmoe.chat import parser as chat_parser
from jaxmoe.chat.decoding import MarkupIds
from jaxmoe.chat.template import render
from jaxmoe.chat.tokenizer import Tokenizer
from jaxmoe.config import MESH_AXES, ConfigError, MeshConfig
from jaxmoe.rl import demos, domains
from jaxmoe.rl.config import load_rl_config
from jaxmoe.rl.domains import DOMAINS, answer_from
from jaxmoe.rl.loop import _restore_params, init_root
from jaxmoe.rl.sft import demonstration_ids, nll, sft_batch
from jaxmoe.train.step import Trainer

BUDGETS = {"low": 4, "high": 8, "max": 16}
MODEL_KEYS = [(k, v) for k, v in OVERRIDES if k.startswith("model.")]


def test_every_budget_question_has_an_answer():
    assert set(demos.BUDGET_ANSWERS) == set(domains.BUDGET_QUESTIONS)
    assert all(a.strip() for a in demos.BUDGET_ANSWERS.values())


def test_example_arguments_validate_for_every_tool():
    for split in domains.SPLITS:
        for tool in domains.tools(split):
            args = demos.example_arguments(tool.schema)
            assert set(args) == set(tool.schema["required"])
    with pytest.raises(ValueError, match="do not validate"):
        demos.example_arguments({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5}},
                                 "required": ["n"]})  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(run):
    return Tokenizer.load(init_root(run.workdir)[1])


@pytest.mark.parametrize("domain", ["code", "tool_args", "budget"])
def test_demonstrations_are_turns_the_verifiers_score(tokenizer, domain):
    """Each training prompt's demonstration, parsed as the engine's output would be, is an answer
    with closed (empty) thinking; code continues the real function, tool arguments validate."""
    ids = MarkupIds.from_tokenizer(tokenizer)
    rewards = []
    for p in DOMAINS[domain].prompts("train", 60, seed=3):
        budget = BUDGETS[p.tier]
        prompt_ids, turn = demonstration_ids(p, tokenizer, budget, ids)
        assert prompt_ids == render(list(p.messages), tokenizer, thinking=True)
        assert turn[0] == ids.think_close and turn[-1] in ids.end_ids
        parsed = chat_parser.parse(turn, tokenizer, thinking=True)
        assert parsed.content == demos.demonstration(p) and parsed.reasoning_tokens == 0
        answer = answer_from(parsed, thinking_budget=budget, finished=True)
        rewards.append(DOMAINS[domain].reward(p.data, answer))
    if domain == "code":
        assert min(rewards) >= 0.5 and np.mean(rewards) > 0.7  # the stdlib's own next lines
    else:
        assert min(rewards) == 1.0


def test_heldout_prompts_have_no_demonstration():
    for domain in ("code", "tool_args", "budget"):
        for p in DOMAINS[domain].prompts("heldout", 5, seed=0):
            with pytest.raises(ValueError, match="not"):
                demos.demonstration(p)


def test_sft_batch_masks_exactly_the_demonstration(tokenizer):
    prompts = [DOMAINS[d].prompts("train", 2, seed=1)[i] for d in ("code", "tool_args", "budget") for i in (0, 1)]
    batch = sft_batch(prompts, tokenizer, BUDGETS, max_tokens=24)
    assert batch.inputs.shape == batch.targets.shape == batch.mask.shape and batch.inputs.shape[1] % 64 == 0
    np.testing.assert_array_equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    ids = MarkupIds.from_tokenizer(tokenizer)
    for b, p in enumerate(prompts):
        prompt_ids, turn = demonstration_ids(p, tokenizer, BUDGETS[p.tier], ids)
        np.testing.assert_array_equal(batch.inputs[b, : len(prompt_ids)], prompt_ids)
        assert batch.targets[b][batch.mask[b] > 0].tolist() == turn[:24]


def test_nll_matches_numpy(run, tokenizer):
    cfg, rl = load_rl_config("configs/tiny.py:rl", MODEL_KEYS)
    cfg = dataclasses.replace(cfg, mesh=MeshConfig())
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1, 1), MESH_AXES)
    prompts = [DOMAINS[d].prompts("train", 1, seed=2)[0] for d in ("code", "tool_args", "budget")]
    batch = sft_batch(prompts, tokenizer, BUDGETS, max_tokens=24)
    with jax.set_mesh(mesh):
        trainer = Trainer(cfg, mesh)
        params, bias = _restore_params(init_root(run.workdir)[0], trainer, cfg)
        got = float(jax.jit(nll, static_argnums=0)(trainer.graphdef, params, bias, batch))
        model = nnx.merge(trainer.graphdef, params, bias)
        logits = np.asarray(jax.jit(lambda m, x: m(x))(model, batch.inputs), np.float64)
    z = logits - logits.max(-1, keepdims=True)
    logz = z - np.log(np.exp(z).sum(-1, keepdims=True))
    picked = np.take_along_axis(logz, batch.targets[..., None].astype(np.int64), -1)[..., 0]
    want = -(picked * batch.mask).sum() / batch.mask.sum()
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_cold_start_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="rl.sft.steps"):
        load_rl_config("configs/tiny.py:rl", [("rl.sft.steps", "-1")])
    with pytest.raises(ConfigError, match="rl.sft.learning_rate"):
        load_rl_config("configs/tiny.py:rl", [("rl.sft.learning_rate", "0.0")])
    with pytest.raises(ConfigError, match="rl.beta"):
        load_rl_config("configs/tiny.py:rl", [("rl.beta", "0.1")])
    load_rl_config("configs/tiny.py:rl", [("rl.beta", "0.1"), ("rl.sft.steps", "0")])
