"""Thinking tiers: flag parsing, effort and budget mapping, auto routing, and the per-tier gate."""

import asyncio
import random

import pytest

from jaxmoe.serve import tiers
from jaxmoe.serve.metrics import Metrics
from jaxmoe.serve.tiers import (
    DEFAULT_BUDGETS,
    DEFAULT_SLOTS,
    TIERS,
    QueueFull,
    TierGate,
    parse_tier_values,
    route,
    tier_for_budget,
    tier_for_effort,
)

TIMEOUT_S = 5.0


def run(coro):
    """Runs a test coroutine on a fresh loop, bounded in time."""
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


# --- flags ---------------------------------------------------------------------------------------


def test_parse_defaults_and_partial_values():
    assert parse_tier_values(None, "--thinking-budgets") == DEFAULT_BUDGETS
    assert parse_tier_values("", "--tier-slots") == DEFAULT_SLOTS
    assert parse_tier_values(" max = 65536 , low=0", "--thinking-budgets") == {"low": 0, "high": 4096, "max": 65536}
    assert parse_tier_values("low=1,high=2,max=3", "--tier-slots") == {"low": 1, "high": 2, "max": 3}
    assert parse_tier_values("high=9", "--tier-slots", defaults={"low": 7, "high": 1, "max": 1}) == {
        "low": 7,
        "high": 9,
        "max": 1,
    }
    assert list(parse_tier_values("max=1,low=1", "--tier-slots")) == list(TIERS)


@pytest.mark.parametrize(
    "text, what, match",
    [
        ("medium=5", "--thinking-budgets", r"--thinking-budgets: 'medium=5'.*low, high, max"),
        ("low", "--tier-slots", r"--tier-slots: 'low'.*TIER=N"),
        ("low=1,low=2", "--tier-slots", r"--tier-slots: tier 'low' is given twice"),
        ("low=-1", "--thinking-budgets", r"--thinking-budgets: low='-1' is not an integer >= 0"),
        ("high=1.5", "--thinking-budgets", r"--thinking-budgets: high='1.5' is not an integer >= 0"),
        ("max=lots", "--tier-slots", r"--tier-slots: max='lots' is not an integer >= 1"),
        ("max=", "--tier-slots", r"--tier-slots: max='' is not an integer >= 1"),
        ("low=0", "--tier-slots", r"--tier-slots: low='0' is not an integer >= 1"),
        ("low=5000", "--thinking-budgets", r"--thinking-budgets: .*not decrease.*low=5000 > high=4096"),
        ("low=0,high=10,max=5", "--thinking-budgets", r"--thinking-budgets: .*high=10 > max=5"),
    ],
)
def test_parse_errors_name_the_flag_the_tier_and_the_allowed(text, what, match):
    with pytest.raises(ValueError, match=match):
        parse_tier_values(text, what)


def test_parse_unknown_flag():
    with pytest.raises(ValueError, match="what: one of"):
        parse_tier_values("low=1", "--slots")


# --- effort and budget ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "effort, want",
    [
        ("none", ("low", False)),
        ("minimal", ("low", True)),
        ("low", ("low", True)),
        ("medium", ("high", True)),
        ("high", ("high", True)),
        ("xhigh", ("max", True)),
        ("max", ("max", True)),
    ],
)
def test_every_effort(effort, want):
    assert tier_for_effort(effort) == want


@pytest.mark.parametrize("effort", ["Medium", "", "ultra", None, 3])
def test_bad_effort_lists_the_allowed(effort):
    with pytest.raises(ValueError, match="reasoning_effort: one of none, minimal, low, medium, high, xhigh, max"):
        tier_for_effort(effort)


@pytest.mark.parametrize(
    "n, want",
    [
        (1, ("low", 1)),
        (511, ("low", 511)),
        (512, ("low", 512)),
        (513, ("high", 513)),
        (4096, ("high", 4096)),
        (4097, ("max", 4097)),
        (32768, ("max", 32768)),
        (32769, ("max", 32768)),
        (10**9, ("max", 32768)),
    ],
)
def test_budget_mapping(n, want):
    assert tier_for_budget(n) == want
    assert tier_for_budget(n, DEFAULT_BUDGETS) == want


def test_budget_mapping_with_custom_budgets():
    budgets = parse_tier_values("low=0,high=100,max=100", "--thinking-budgets")
    assert tier_for_budget(1, budgets) == ("high", 1)
    assert tier_for_budget(100, budgets) == ("high", 100)
    assert tier_for_budget(101, budgets) == ("max", 100)


@pytest.mark.parametrize("n", [0, -5, True, 1.5, "10", None])
def test_bad_budget(n):
    with pytest.raises(ValueError, match="thinking.budget_tokens: an integer >= 1"):
        tier_for_budget(n)


# --- auto routing --------------------------------------------------------------------------------


def user(text):
    return {"role": "user", "content": text}


SEARCH = {"name": "search_docs", "description": "Full-text search over the documentation."}
WEATHER = {"name": "get_weather", "description": "Current weather for a city."}
HISTORY_WITH_RESULT = [
    user("What does the retry policy say?"),
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "name": "search_docs", "arguments": "{}"}]},
    {"role": "tool", "tool_call_id": "c1", "content": "Retries back off exponentially."},
]


@pytest.mark.parametrize(
    "messages, tools, want",
    [
        ([user("hi")], [{"name": "run_shell", "description": "Runs a program."}], ("max", "terminal-tool")),
        ([user("hi")], [{"name": "bash"}], ("max", "terminal-tool")),
        ([user("hi")], [{"name": "tty", "description": "Type into the Terminal."}], ("max", "terminal-tool")),
        ([user("hi")], [WEATHER, {"name": "run", "description": "Executes a command."}], ("max", "terminal-tool")),
        ([user("hi")], [{"name": "python_exec", "description": None}], ("max", "terminal-tool")),
        (HISTORY_WITH_RESULT, [WEATHER, {"name": "x", "description": "a shell"}], ("max", "terminal-tool")),
        (HISTORY_WITH_RESULT, [SEARCH], ("max", "tool-results")),
        (HISTORY_WITH_RESULT, None, ("low", "simple")),  # results but no tools offered any more
        ([user("What is the weather in Oslo?")], [WEATHER], ("high", "tools-offered")),
        ([user("Solve it step by step: 3x + 1 = 10")], None, ("high", "reasoning-cue")),
        ([user("Prove that sqrt(2) is irrational.")], [], ("high", "reasoning-cue")),
        ([user("why is the sky blue")], None, ("high", "reasoning-cue")),
        ([user("Help me DEBUG this segfault")], None, ("high", "reasoning-cue")),
        ([user("Analyse the logs")], None, ("high", "reasoning-cue")),
        ([user("Calculate 17 * 23")], None, ("high", "reasoning-cue")),
        ([user("Compare Rust and Go")], None, ("high", "reasoning-cue")),
        ([user("Derive the gradient")], None, ("high", "reasoning-cue")),
        ([user("Plan a three-day trip")], None, ("high", "reasoning-cue")),
        ([user("x" * 601)], None, ("high", "long-prompt")),
        ([user("x" * 600)], None, ("low", "simple")),
        ([user("Who? What? Where?")], None, ("high", "many-questions")),
        ([user("Really??? Who?")], None, ("low", "simple")),  # a run of ? is one question
        ([user("What is the capital of France?")], None, ("low", "simple")),
        ([user("Please improve and approve this planet fact.")], None, ("low", "simple")),  # no cue at a word start
        ([], None, ("low", "simple")),
    ],
)
def test_route_rules(messages, tools, want):
    assert route(messages, tools) == want


def test_route_reads_the_last_user_message_and_text_parts():
    earlier_cue = [user("Why?"), {"role": "assistant", "content": "Because."}, user("Thanks, and the capital?")]
    assert route(earlier_cue, None) == ("low", "simple")
    parts = [
        {
            "role": "user",
            "content": [{"type": "image", "source": {}}, {"type": "text", "text": "Compare these two images."}],
        }
    ]
    assert route(parts, None) == ("high", "reasoning-cue")
    system_only = [{"role": "system", "content": "Think step by step."}, user("hello")]
    assert route(system_only, None) == ("low", "simple")


def test_route_accepts_openai_function_tools():
    tool = {"type": "function", "function": {"name": "terminal", "description": "", "parameters": {}}}
    assert route([user("hi")], [tool]) == ("max", "terminal-tool")


def test_docstring_lists_every_rule():
    for name in ["terminal-tool", "tool-results", "tools-offered", "reasoning-cue", "long-prompt", "many-questions"]:
        assert f"``{name}``" in tiers.__doc__


# --- TierGate ------------------------------------------------------------------------------------


async def until(predicate):
    """Yields to the loop until ``predicate()`` holds (bounded by the caller's wait_for)."""
    while not predicate():
        await asyncio.sleep(0)


async def hold(gate, tier, release, log=None, name=None):
    """Enters a slot of ``tier``, notes ``name`` in ``log``, and holds it until ``release`` is set."""
    async with gate.slot(tier):
        if log is not None:
            log.append(name)
        await asyncio.wait_for(release.wait(), TIMEOUT_S)


def gauge(metrics, name, tier):
    return metrics.registry.get_sample_value(name, {"tier": tier})


def test_fifo_order_within_a_tier():
    async def main():
        gate = TierGate({"low": 1}, max_queue=10)
        log, first, rest = [], asyncio.Event(), asyncio.Event()
        holder = asyncio.create_task(hold(gate, "low", first, log, "holder"))
        await until(lambda: gate.running("low") == 1)
        waiters = []
        for i in range(5):
            waiters.append(asyncio.create_task(hold(gate, "low", rest, log, i)))
            await until(lambda i=i: gate.depth("low") == i + 1)
        rest.set()  # waiters leave as soon as they enter: the order of entry is the order of the queue
        first.set()
        await asyncio.wait_for(asyncio.gather(holder, *waiters), TIMEOUT_S)
        assert log == ["holder", 0, 1, 2, 3, 4]
        assert gate.running("low") == gate.depth("low") == 0

    run(main())


def test_slots_run_at_once_and_gauges_follow():
    async def main():
        metrics = Metrics(TIERS)
        gate = TierGate({"low": 2, "high": 1, "max": 1}, max_queue=4, metrics=metrics)
        release = asyncio.Event()
        tasks = [asyncio.create_task(hold(gate, "low", release)) for _ in range(5)]
        await until(lambda: gate.depth("low") == 3)
        assert gate.running("low") == 2
        assert gauge(metrics, "jaxmoe_requests_running", "low") == 2
        assert gauge(metrics, "jaxmoe_queue_depth", "low") == 3
        assert gauge(metrics, "jaxmoe_queue_depth", "high") == 0
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
        assert gauge(metrics, "jaxmoe_requests_running", "low") == 0
        assert gauge(metrics, "jaxmoe_queue_depth", "low") == 0

    run(main())


def test_low_is_admitted_while_max_is_saturated_and_its_queue_full():
    async def main():
        gate = TierGate({"low": 1, "high": 1, "max": 1}, max_queue=2)
        release_max, release_low = asyncio.Event(), asyncio.Event()
        maxes = [asyncio.create_task(hold(gate, "max", release_max)) for _ in range(3)]
        await until(lambda: gate.depth("max") == 2)
        with pytest.raises(QueueFull):
            await asyncio.wait_for(gate.slot("max").__aenter__(), TIMEOUT_S)
        log = []
        low = asyncio.create_task(hold(gate, "low", release_low, log, "low"))
        await asyncio.wait_for(until(lambda: log == ["low"]), 1.0)  # in at once, Max still full
        assert gate.running("max") == 1 and gate.depth("max") == 2
        release_low.set()
        await asyncio.wait_for(low, TIMEOUT_S)
        release_max.set()
        await asyncio.wait_for(asyncio.gather(*maxes), TIMEOUT_S)

    run(main())


def test_queue_full_is_immediate_with_retry_after():
    async def main():
        gate = TierGate({"high": 2}, max_queue=3, default_service_s=10.0)
        release = asyncio.Event()
        tasks = [asyncio.create_task(hold(gate, "high", release)) for _ in range(5)]
        await until(lambda: gate.depth("high") == 3)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(QueueFull) as e:
            await asyncio.wait_for(gate.slot("high").__aenter__(), TIMEOUT_S)
        assert loop.time() - start < 0.5
        assert e.value.tier == "high"
        assert e.value.retry_after == 20  # 10 s x place 4 / 2 slots
        assert isinstance(e.value.retry_after, int)
        assert "high" in str(e.value) and "20" in str(e.value)
        assert gate.depth("high") == 3 and gate.running("high") == 2  # the refusal changed nothing
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)

    run(main())


def test_retry_after_follows_recent_service_times(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(tiers.time, "monotonic", lambda: clock[0])

    async def main():
        gate = TierGate({"max": 1}, max_queue=1)
        async with gate.slot("max"):
            clock[0] += 30.0  # a 30 s request
        assert gate.retry_after("max") == 30
        release = asyncio.Event()
        tasks = [asyncio.create_task(hold(gate, "max", release)) for _ in range(2)]
        await until(lambda: gate.depth("max") == 1)
        with pytest.raises(QueueFull) as e:
            await asyncio.wait_for(gate.slot("max").__aenter__(), TIMEOUT_S)
        assert e.value.retry_after == 60
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
        for _ in range(40):  # fast requests push the slow one out of the window
            async with gate.slot("max"):
                clock[0] += 0.01
        assert gate.retry_after("max") == 1

    run(main())


def test_no_queue_refuses_when_busy():
    async def main():
        gate = TierGate({"low": 1}, max_queue=0)
        release = asyncio.Event()
        task = asyncio.create_task(hold(gate, "low", release))
        await until(lambda: gate.running("low") == 1)
        with pytest.raises(QueueFull) as e:
            await asyncio.wait_for(gate.slot("low").__aenter__(), TIMEOUT_S)
        assert e.value.retry_after >= 1
        release.set()
        await asyncio.wait_for(task, TIMEOUT_S)

    run(main())


def test_cancelled_waiter_leaves_no_trace():
    async def main():
        metrics = Metrics(TIERS)
        gate = TierGate({"low": 1, "high": 1, "max": 1}, max_queue=1, metrics=metrics)
        release = asyncio.Event()
        holder = asyncio.create_task(hold(gate, "max", release))
        await until(lambda: gate.running("max") == 1)
        waiter = asyncio.create_task(hold(gate, "max", release))
        await until(lambda: gate.depth("max") == 1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiter, TIMEOUT_S)
        assert gate.depth("max") == 0 and gauge(metrics, "jaxmoe_queue_depth", "max") == 0
        # Its place is free again: a new waiter is queued, not refused.
        again = asyncio.create_task(hold(gate, "max", release))
        await until(lambda: gate.depth("max") == 1)
        release.set()
        await asyncio.wait_for(asyncio.gather(holder, again), TIMEOUT_S)
        assert gate.running("max") == gate.depth("max") == 0
        assert gauge(metrics, "jaxmoe_requests_running", "max") == 0

    run(main())


def test_timed_out_waiter_leaves_no_trace():
    async def main():
        gate = TierGate({"low": 1}, max_queue=1)
        release = asyncio.Event()
        holder = asyncio.create_task(hold(gate, "low", release))
        await until(lambda: gate.running("low") == 1)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(hold(gate, "low", release), 0.05)
        assert gate.depth("low") == 0 and gate.running("low") == 1
        release.set()
        await asyncio.wait_for(holder, TIMEOUT_S)
        assert gate.running("low") == 0
        await asyncio.wait_for(hold(gate, "low", release), TIMEOUT_S)  # the slot is free

    run(main())


def test_cancelled_just_after_the_handover_passes_the_slot_on():
    async def main():
        gate = TierGate({"low": 1}, max_queue=5)
        log, release, go = [], asyncio.Event(), asyncio.Event()
        tasks = {}

        async def holder():
            async with gate.slot("low"):
                await asyncio.wait_for(go.wait(), TIMEOUT_S)
            # The slot was just handed to the first waiter; it is cancelled before it resumes.
            tasks["first"].cancel()

        h = asyncio.create_task(holder())
        await until(lambda: gate.running("low") == 1)
        tasks["first"] = asyncio.create_task(hold(gate, "low", release, log, "first"))
        await until(lambda: gate.depth("low") == 1)
        tasks["second"] = asyncio.create_task(hold(gate, "low", release, log, "second"))
        await until(lambda: gate.depth("low") == 2)
        go.set()
        await asyncio.wait_for(h, TIMEOUT_S)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(tasks["first"], TIMEOUT_S)
        await asyncio.wait_for(until(lambda: log == ["second"]), TIMEOUT_S)
        assert gate.running("low") == 1 and gate.depth("low") == 0
        release.set()
        await asyncio.wait_for(tasks["second"], TIMEOUT_S)
        assert gate.running("low") == 0

    run(main())


def test_a_failing_body_frees_its_slot():
    async def main():
        gate = TierGate({"low": 1}, max_queue=0)
        with pytest.raises(RuntimeError):
            async with gate.slot("low"):
                raise RuntimeError("engine failed")
        assert gate.running("low") == 0
        async with gate.slot("low"):
            assert gate.running("low") == 1

    run(main())


def test_gate_argument_errors():
    with pytest.raises(ValueError, match=r"slots\['low'\]: an integer >= 1"):
        TierGate({"low": 0}, max_queue=1)
    with pytest.raises(ValueError, match="max_queue: an integer >= 0"):
        TierGate({"low": 1}, max_queue=-1)
    with pytest.raises(ValueError, match="slots: at least one tier"):
        TierGate({}, max_queue=1)
    gate = TierGate({"low": 1}, max_queue=1)
    with pytest.raises(ValueError, match="tier: one of low, got 'max'"):
        gate.depth("max")

    async def enter_unknown():
        async with gate.slot("max"):
            pass

    with pytest.raises(ValueError, match="tier: one of low"):
        run(enter_unknown())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_cancellations_never_leak_or_overfill(seed):
    rng = random.Random(seed)

    async def main():
        metrics = Metrics(TIERS)
        gate = TierGate({"low": 2, "high": 1, "max": 3}, max_queue=4, metrics=metrics)
        inside = dict.fromkeys(TIERS, 0)
        peak = dict.fromkeys(TIERS, 0)
        refused = []

        async def request(tier):
            try:
                async with gate.slot(tier):
                    inside[tier] += 1
                    peak[tier] = max(peak[tier], inside[tier])
                    try:
                        for _ in range(rng.randrange(20)):
                            await asyncio.sleep(0)
                    finally:
                        inside[tier] -= 1
            except QueueFull as e:
                refused.append(e.retry_after)

        tasks = []
        for _ in range(300):
            tasks.append(asyncio.create_task(request(rng.choice(TIERS))))
            if rng.random() < 0.3:
                rng.choice(tasks).cancel()
            for _ in range(rng.randrange(3)):
                await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), TIMEOUT_S)
        assert refused and min(refused) >= 1
        assert peak == {"low": 2, "high": 1, "max": 3}
        for tier in TIERS:
            assert gate.running(tier) == gate.depth(tier) == 0
            assert gauge(metrics, "jaxmoe_requests_running", tier) == 0
            assert gauge(metrics, "jaxmoe_queue_depth", tier) == 0

    run(main())
