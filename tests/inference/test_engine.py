"""The engine end to end on the tiny hybrid model: batching, sampling, preemption, prefix reuse, pages.

One model is shared by the module, and one jitted full forward by every reference (weights as
arguments); the engines of one pool size share their step programs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from inference_helpers import full_forward, inference_model_config, small_engine

from jaxmoe.config import load_config
from jaxmoe.inference import Request, SamplingParams
from jaxmoe.inference.cache import _maintain
from jaxmoe.inference.engine import _step_jit
from jaxmoe.inference.programs import Shape, step_key
from jaxmoe.model import create_model

VOCAB = 512
PROMPT_LENGTHS = (3, 17, 29, 8, 40)


@pytest.fixture(scope="module")
def model():
    cfg = inference_model_config(load_config("configs/tiny.py").model)
    cfg = dataclasses.replace(cfg, indexer=dataclasses.replace(cfg.indexer, topk=8))
    return create_model(cfg, seed=0)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [tuple(rng.integers(0, VOCAB, n).tolist()) for n in PROMPT_LENGTHS]


def _full_forward_greedy(model, prompt, n):
    """Reference: argmax of the whole forward, one position at a time (a fixed 64-token buffer)."""
    fwd = full_forward(model)
    toks, logprobs = list(prompt), []
    for _ in range(n):
        buf = np.zeros((1, 64), np.int32)
        buf[0, : len(toks)] = toks
        row = np.asarray(fwd(buf))[0, len(toks) - 1]
        toks.append(int(np.argmax(row)))
        logprobs.append(float(jax.nn.log_softmax(jnp.asarray(row))[toks[-1]]))
    return toks[len(prompt) :], logprobs


def test_greedy_batch_equals_full_forward(model, prompts):
    engine = small_engine(model)
    outs = engine.generate([Request(p, max_tokens=9) for p in prompts])
    for p, o in zip(prompts, outs):
        ids, logprobs = _full_forward_greedy(model, p, 9)
        assert o.output_ids == ids and o.finish_reason == "length"
        np.testing.assert_allclose(o.logprobs, logprobs, atol=1e-4)
    assert engine.stats["prefill_tokens"] == sum(PROMPT_LENGTHS) and engine.stats["decode_tokens"] == 8 * len(prompts)


def _sampled(temperature=0.9, top_p=0.9, top_k=0, seed=7):
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)


def test_same_tokens_alone_and_in_a_busy_batch(model, prompts):
    request = Request(prompts[1], max_tokens=12, sampling=_sampled())
    alone = small_engine(model).generate([request])[0]
    others = [
        Request(p, max_tokens=n, sampling=_sampled(seed=i)) for i, (p, n) in enumerate(zip(prompts, (5, 20, 3, 9, 14)))
    ]
    busy = small_engine(model, step_tokens=24, chunk_size=8).generate(others[:2] + [request] + others[2:])[2]
    assert busy.output_ids == alone.output_ids
    np.testing.assert_allclose(busy.logprobs, alone.logprobs, atol=1e-4)
    # another seed samples something else (the test can tell seeds apart)
    other = small_engine(model).generate([dataclasses.replace(request, sampling=_sampled(seed=8))])[0]
    assert other.output_ids != alone.output_ids


def test_top_k_one_is_greedy(model, prompts):
    greedy = small_engine(model).generate([Request(prompts[2], max_tokens=6)])[0]
    top1 = small_engine(model).generate([Request(prompts[2], max_tokens=6, sampling=_sampled(top_k=1))])[0]
    assert top1.output_ids == greedy.output_ids


def test_preemption_leaves_outputs_unchanged(model, prompts):
    requests = [Request(p, max_tokens=16, sampling=_sampled(seed=i)) for i, p in enumerate(prompts)]
    roomy = small_engine(model).generate(requests)
    # 12 pages of 8 positions (96 tokens) for five sequences of up to 56: preemption is certain.
    engine = small_engine(model, cache_bytes=_bytes_for_pages(model, 13, 8))
    tight = engine.generate(requests)
    assert engine.scheduler.preemptions > 0
    assert [o.output_ids for o in tight] == [o.output_ids for o in roomy]
    _assert_pools_empty_and_zero(engine)


def _bytes_for_pages(model, pages, page_size):
    from jaxmoe.inference import CacheSpec

    probe = CacheSpec.for_model(model.cfg, num_pages=pages, num_slots=8, page_size=page_size)
    return probe.total_bytes


def _assert_pools_empty_and_zero(engine):
    engine.step()  # zeroes what the last step freed
    sched = engine.scheduler
    assert sched.pages.num_free == sched.pages.capacity and sched.slots.num_free == sched.slots.num_slots
    for kind, pools in engine.cache.items():
        for pool in pools:
            assert not np.any(np.asarray(pool)), f"{kind} pool holds data after every request ended"


def test_pages_return_after_finished_cancelled_and_preempted(model, prompts):
    engine = small_engine(model, cache_bytes=_bytes_for_pages(model, 13, 8))
    ids = [engine.submit(Request(p, max_tokens=16)) for p in prompts]
    for _ in range(3):
        engine.step()
    engine.cancel(ids[0])  # running
    engine.cancel(ids[4])  # probably still waiting
    while engine.has_work():
        engine.step()
    assert engine.completion(ids[0]).finish_reason == "cancelled"
    assert {engine.completion(i).finish_reason for i in ids[1:4]} == {"length"}
    _assert_pools_empty_and_zero(engine)


def test_reused_page_holds_no_earlier_data(model, prompts):
    engine = small_engine(model)
    engine.generate([Request(prompts[4], max_tokens=4)])
    engine.step()
    # every page the finished request wrote is zero before anyone else gets it
    assert all(not np.any(np.asarray(p)) for p in engine.cache["latent"] + engine.cache["index"])
    seq_id = engine.submit(Request(prompts[0], max_tokens=2))
    engine.step()
    seq = engine.sequences[seq_id]
    latent = np.asarray(engine.cache["latent"][0])
    written = latent[seq.pages].reshape(-1, latent.shape[-1])
    assert np.all(np.any(written[: len(prompts[0])] != 0, axis=-1)) and not np.any(written[len(prompts[0]) :])


def test_prefix_reuse_equals_cold_start_and_computes_only_new_tokens(model, prompts):
    turn1 = Request(prompts[2], max_tokens=7, tenant="alice")
    engine = small_engine(model)
    first = engine.generate([turn1])[0]
    history = prompts[2] + tuple(first.output_ids) + prompts[1][:11]  # + the next user message
    before = engine.stats["prefill_tokens"]
    second = engine.generate([Request(history, max_tokens=7, tenant="alice")])[0]
    computed = engine.stats["prefill_tokens"] - before
    cached = len(prompts[2]) + len(first.output_ids) - 1  # the last sampled token was never fed
    assert second.cached_tokens == cached and computed == len(history) - cached
    cold = small_engine(model, prefix_cache=False).generate([Request(history, max_tokens=7)])[0]
    assert second.output_ids == cold.output_ids
    np.testing.assert_allclose(second.logprobs, cold.logprobs, atol=1e-4)
    # another tenant computes everything
    bob = engine.generate([Request(history, max_tokens=7, tenant="bob")])[0]
    assert bob.cached_tokens == 0 and bob.output_ids == cold.output_ids


def test_next_turn_reuses_the_prompt_snapshot_whatever_the_reply(model, prompts):
    """An agent's next turn re-sends its prompt, then a re-encoded reply that differs from the tokens
    sampled: the entry taken at the prompt's end still matches (state snapshot at that boundary),
    and the output equals a cold start, in a batch with other requests."""
    engine = small_engine(model)
    first = engine.generate([Request(prompts[4], max_tokens=5, tenant="alice")])[0]
    history = prompts[4] + tuple((t + 1) % VOCAB for t in first.output_ids) + prompts[0]  # not the sampled reply
    busy = [Request(p, max_tokens=5) for p in prompts[:2]]
    outs = engine.generate([Request(history, max_tokens=6, tenant="alice"), *busy])
    assert outs[0].cached_tokens == len(prompts[4])
    cold = small_engine(model, prefix_cache=False).generate([Request(history, max_tokens=6)])[0]
    assert outs[0].output_ids == cold.output_ids
    np.testing.assert_allclose(outs[0].logprobs, cold.logprobs, atol=1e-4)


def test_refusals_name_the_limit(model):
    engine = small_engine(model, cache_bytes=_bytes_for_pages(model, 5, 8))
    with pytest.raises(ValueError, match="max_context 4096"):
        engine.submit(Request((1,) * 4000, max_tokens=100))
    with pytest.raises(ValueError, match="exceeds the page pool"):
        engine.submit(Request((1,) * 30, max_tokens=20))
    with pytest.raises(ValueError, match=r"prompt_ids must be in \[0, 512\)"):
        engine.submit(Request((1, 512)))
    with pytest.raises(ValueError, match="must not be empty"):
        engine.submit(Request(()))
    with pytest.raises(ValueError, match="detokenizer"):
        engine.submit(Request((1, 2), max_tokens=2, stop=("x",)))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_eos_stop_strings_and_ignore_eos(model, prompts):
    greedy = small_engine(model).generate([Request(prompts[3], max_tokens=8)])[0].output_ids
    eos = greedy[3]
    detok = lambda ids: " ".join(str(i) for i in ids)
    engine = small_engine(model, eos_id=eos, detokenize=detok)
    first = greedy.index(eos)
    stopped, ignored, by_string, at_least, string_later = engine.generate(
        [
            Request(prompts[3], max_tokens=8),
            Request(prompts[3], max_tokens=8, ignore_eos=True),
            Request(prompts[3], max_tokens=8, stop=(f" {greedy[2]}",), ignore_eos=True),
            Request(prompts[3], max_tokens=8, min_tokens=first + 2),
            Request(prompts[3], max_tokens=8, stop=(f" {greedy[2]}",), ignore_eos=True, min_tokens=5),
        ]
    )
    assert stopped.output_ids == greedy[: first + 1] and stopped.finish_reason == "stop"
    assert stopped.text == detok(greedy[:first])
    assert ignored.output_ids == greedy and ignored.finish_reason == "length"
    assert by_string.finish_reason == "stop" and by_string.output_ids == greedy[:3]
    assert by_string.text == detok(greedy[:2])
    # min_tokens: eos is masked out of the first first + 2 tokens (HF min_new_tokens), allowed after
    no_eos = np.arange(VOCAB) != eos
    free = np.ones(VOCAB, bool)
    ids, logprobs = _masked_greedy(model, prompts[3], [no_eos] * (first + 2) + [free] * (6 - first))
    end = ids.index(eos) + 1 if eos in ids else len(ids)
    assert eos not in ids[: first + 2] and at_least.output_ids == ids[:end]
    np.testing.assert_allclose(at_least.logprobs, logprobs[:end], atol=1e-4)
    # a stop string is looked for once min_tokens are out (and still cuts the text where it starts)
    assert string_later.finish_reason == "stop" and string_later.output_ids == greedy[:5]
    assert string_later.text == detok(greedy[:2])
    with pytest.raises(ValueError, match="min_tokens must be in"):
        engine.submit(Request(prompts[3], max_tokens=4, min_tokens=5))


class _Allow:
    """A constraint that allows a different random set of tokens at each position, and records."""

    def __init__(self, seed):
        self.rng, self.seen, self.masks = np.random.default_rng(seed), [], []

    def allowed(self):
        mask = self.rng.random(VOCAB) < 0.05
        mask[self.rng.integers(VOCAB)] = True
        self.masks.append(mask)
        return mask

    def accept(self, token):
        self.seen.append(token)


def _masked_greedy(model, prompt, masks):
    """Reference: argmax over each position's allowed tokens of the whole forward."""
    fwd = full_forward(model)
    toks, logprobs = list(prompt), []
    for mask in masks:
        buf = np.zeros((1, 64), np.int32)
        buf[0, : len(toks)] = toks
        row = np.where(mask, np.asarray(fwd(buf))[0, len(toks) - 1], -np.inf)
        toks.append(int(np.argmax(row)))
        logprobs.append(float(jax.nn.log_softmax(jnp.asarray(row))[toks[-1]]))
    return toks[len(prompt) :], logprobs


def test_constraint_masks_each_sampled_token_and_sees_every_one(model, prompts):
    """Constrained and free rows in one batch: each constrained row's tokens are the argmax over its
    masks, the constraint is asked once per sampled token and told each token."""
    constraints = [_Allow(i) if i % 2 == 0 else None for i in range(len(prompts))]
    requests = [Request(p, max_tokens=6, constraint=c) for p, c in zip(prompts, constraints)]
    outs = small_engine(model).generate(requests)
    for p, c, o in zip(prompts, constraints, outs):
        if c is None:
            assert o.output_ids == _full_forward_greedy(model, p, 6)[0]
            continue
        assert len(c.masks) == 6 and c.seen == o.output_ids
        ids, logprobs = _masked_greedy(model, p, c.masks)
        assert o.output_ids == ids
        np.testing.assert_allclose(o.logprobs, logprobs, atol=1e-4)


def test_stop_ids_end_the_output(model, prompts):
    greedy = small_engine(model).generate([Request(prompts[1], max_tokens=8)])[0].output_ids
    out = small_engine(model, detokenize=str).generate([Request(prompts[1], max_tokens=8, stop_ids=(greedy[4],))])[0]
    first = greedy.index(greedy[4])
    assert out.output_ids == greedy[: first + 1] and out.finish_reason == "stop"
    assert out.text == str(greedy[:first])


def test_step_compiles_for_buckets_not_requests(model):
    rng = np.random.default_rng(3)
    lengths = range(20, 36)  # 16 prompt lengths
    start = _step_jit._cache_size()
    small_engine(model).generate([Request(tuple(rng.integers(0, VOCAB, n).tolist()), max_tokens=3) for n in lengths])
    first = _step_jit._cache_size()
    assert first - start < len(lengths)  # shapes come from buckets, not from each request's length
    small_engine(model).generate([Request(tuple(rng.integers(0, VOCAB, n).tolist()), max_tokens=3) for n in lengths])
    assert _step_jit._cache_size() == first  # other requests, the same buckets: no new program


def test_step_key_is_interned_and_never_rehashes_the_graphdef(model, monkeypatch):
    """JAX hashes the step's static argument on every call: the key hashes the graphdef once."""
    spec = small_engine(model).spec
    key = step_key(nnx.split(model)[0], spec)
    assert step_key(nnx.split(model)[0], spec) is key  # an equal graphdef of another split: the same key
    calls = []
    graphdef_type = type(key.graphdef)
    monkeypatch.setattr(graphdef_type, "__hash__", lambda self: calls.append(1) or 0)
    assert hash(key) == hash(key) and calls == []


def test_past_max_programs_the_programs_are_dropped_and_outputs_do_not_change(model, prompts):
    """EngineConfig.max_programs: with 2 programs held, meeting a third shape clears the step's
    compiled programs (XLA:CPU maps each program's code into its own memory sections, and a process
    holds at most vm.max_map_count maps) and the tokens and log-probabilities stay the same."""
    requests = [
        Request(p, max_tokens=7, sampling=SamplingParams(temperature=1.0, seed=i)) for i, p in enumerate(prompts)
    ]
    want = small_engine(model).generate(requests)
    engine = small_engine(model, max_programs=2)
    got = engine.generate(requests)
    assert engine.stats["program_evictions"] >= 1
    assert engine.programs.count() <= 2
    for a, b in zip(got, want):
        assert a.output_ids == b.output_ids
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    with pytest.raises(ValueError, match="max_programs must be >= 1"):
        small_engine(model, max_programs=0)


def test_floors_pad_every_step_to_one_decode_shape_and_outputs_do_not_change(model, prompts):
    """EngineConfig.min_decode_rows / min_context (batch jobs): rows that finish at different steps
    and prompts of different lengths all decode on one shape, the page table as wide as the floor,
    and greedy still equals the full forward."""
    rng = np.random.default_rng(1)
    many = [tuple(rng.integers(0, VOCAB, n).tolist()) for n in rng.integers(2, 50, 12)]
    lengths = [int(n) for n in rng.integers(2, 12, 12)]  # rows finish at different steps
    requests = [Request(p, max_tokens=n) for p, n in zip(many, lengths)]
    engine = small_engine(model, max_seqs=16, min_decode_rows=16, min_context=128)  # 16 pages of 8
    outs = engine.generate(requests)
    for p, n, o in zip(many, lengths, outs):
        ids, logprobs = _full_forward_greedy(model, p, n)
        assert o.output_ids == ids
        np.testing.assert_allclose(o.logprobs, logprobs, atol=1e-4)
    # Unfloored, these rows decode in groups of 16 and then 8 (the engine's own floor), over 8 pages.
    decode = {s for s in engine.programs.known if s.decode_rows}
    assert decode and {(s.decode_rows, s.pages) for s in decode} == {(16, 16)}
    assert all(s.pages == 16 for s in engine.programs.known)
    for name in ("min_decode_rows", "min_context"):
        with pytest.raises(ValueError, match=f"{name} must be >= 0"):
            small_engine(model, **{name: -1})


def test_a_new_shape_runs_padded_while_it_compiles(model, prompts):
    """compile_in_background: a step of a shape the engine has not compiled runs on a compiled shape
    that covers it (more rows, a longer chunk) and gives the same tokens; its own program compiles
    on the compiler thread and serves the next request."""
    engine = small_engine(model, compile_in_background=True)
    engine.generate([Request(p, max_tokens=4) for p in prompts])  # compiles (0 decode, 4 prefill x 16 tokens) first
    short = Shape(decode_rows=0, prefill_rows=1, chunk=8, pages=8, masked=False)  # prompts[0]: 3 tokens, alone
    assert short not in engine.programs.known
    ids, logprobs = _full_forward_greedy(model, prompts[0], 6)
    padded = engine.stats["padded_steps"]
    alone = engine.generate([Request(prompts[0], max_tokens=6)])[0]
    assert engine.stats["padded_steps"] > padded
    assert alone.output_ids == ids
    np.testing.assert_allclose(alone.logprobs, logprobs, atol=1e-4)
    engine.programs.wait()
    assert short in engine.programs.ready
    padded = engine.stats["padded_steps"]
    again = engine.generate([Request(prompts[0], max_tokens=6)])[0]  # its own program now (ahead-of-time compiled)
    assert engine.stats["padded_steps"] == padded and again.output_ids == ids
    np.testing.assert_allclose(again.logprobs, logprobs, atol=1e-4)


def test_after_warm_up_no_step_compiles_on_the_spot(model, prompts):
    """warm_up(context) compiles covers of every step up to ``context`` positions on the compiler
    thread, and the pools' maintenance: afterwards a batch of mixed prompts runs without compiling
    a program on the spot, and its tokens are the reference's."""
    assert small_engine(model).warm_up(64) == []  # compiling before each step: nothing to warm
    engine = small_engine(model, compile_in_background=True)
    assert engine.warm_up(0) == []
    covers = engine.warm_up(64)  # 8 pages of 8 positions: one page-table width
    maintenance_programs = _maintain._cache_size()
    assert {s.pages for s in covers} == {8} and all(s.masked for s in covers)
    assert max(s.decode_rows for s in covers) == 4 and max(s.chunk for s in covers) == 16
    engine.programs.wait()
    assert set(covers) <= set(engine.programs.ready)
    lengths = [3, 17, 29, 8]
    outs = engine.generate([Request(p, max_tokens=40 - n) for p, n in zip(prompts, lengths, strict=False)])
    assert engine.stats["compiles_on_the_spot"] == 0 and engine.stats["padded_steps"] > 0
    assert _maintain._cache_size() == maintenance_programs  # freeing the pages compiled nothing either
    for p, n, o in zip(prompts, lengths, outs, strict=False):
        ids, logprobs = _full_forward_greedy(model, p, 40 - n)
        assert o.output_ids == ids
        np.testing.assert_allclose(o.logprobs, logprobs, atol=1e-4)
