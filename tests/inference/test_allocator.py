"""Host-side pools and the scheduler's bookkeeping: no device work."""

import numpy as np
import pytest

from jaxmoe.inference.allocator import OutOfPages, PagePool, SlotPool, pages_for
from jaxmoe.inference.prefix import PrefixCache, PrefixEntry
from jaxmoe.inference.scheduler import Request, Scheduler, Sequence


def test_page_pool_never_hands_out_the_null_page_and_refcounts():
    pool = PagePool(5)
    pages = pool.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and pool.num_free == 0
    with pytest.raises(OutOfPages):
        pool.allocate(1)
    pool.share(pages[:2])
    pool.release(pages)
    assert pool.num_free == 2 and sorted(pool.take_zeroing()) == sorted(pages[2:])
    pool.release(pages[:2])
    assert pool.num_free == 4 and sorted(pool.take_zeroing()) == sorted(pages[:2])
    with pytest.raises(ValueError, match="released more often"):
        pool.release([pages[0]])


def test_slot_pool():
    pool = SlotPool(2)
    a, b = pool.allocate(), pool.allocate()
    with pytest.raises(OutOfPages):
        pool.allocate()
    pool.release(a)
    with pytest.raises(ValueError, match="twice"):
        pool.release(a)
    assert pool.take_zeroing() == [a] and pool.allocate() == a and b != a


def test_pages_for():
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_prefix_cache_is_per_tenant_and_longest_match():
    cache = PrefixCache()
    cache.add(PrefixEntry("a", np.array([1, 2, 3]), [1], 0))
    cache.add(PrefixEntry("a", np.array([1, 2, 3, 4, 5]), [2, 3], 1))
    cache.add(PrefixEntry("b", np.array([1, 2, 3, 4, 5, 6]), [4], 2))
    assert cache.lookup("a", np.array([1, 2, 3, 4, 5, 6, 7]), now=1).slot == 1
    assert cache.lookup("a", np.array([1, 2, 3, 9]), now=1).slot == 0
    assert cache.lookup("a", np.array([1, 2, 3]), now=1) is None  # a prompt needs one new token
    assert cache.lookup("c", np.array([1, 2, 3, 4, 5, 6, 7]), now=1) is None
    assert cache.lookup("b", np.array([1, 2, 3, 4, 5, 6, 7]), now=1).slot == 2


def _scheduler(**kw):
    args = dict(num_pages=9, num_slots=4, page_size=4, max_seqs=2, step_tokens=8, chunk_size=4)
    return Scheduler(**(args | kw))


def _seq(i, n, tenant=None):
    return Sequence(
        id=i, request=Request(tuple(range(1, n + 1)), max_tokens=4, tenant=tenant), tokens=list(range(1, n + 1))
    )


def _run(sched, plan):
    for seq, n in plan.rows:
        seq.computed += n
        if seq.pending == 0:
            seq.tokens.append(7)
            seq.output.append(7)


def test_schedule_mixes_decode_and_prefill_chunks_within_budget():
    sched = _scheduler()
    a, b = _seq(0, 6), _seq(1, 3)
    sched.submit(a)
    sched.submit(b)
    plan = sched.schedule()
    assert [(s.id, n) for s, n in plan.rows] == [(0, 4), (1, 3)]
    _run(sched, plan)
    plan = sched.schedule()  # b decodes (1 token), a finishes its prompt (2 tokens)
    assert sorted((s.id, n) for s, n in plan.rows) == [(0, 2), (1, 1)]
    assert sum(n for _, n in plan.rows) <= 8


def test_preemption_frees_pages_and_requeues_the_youngest():
    sched = _scheduler(num_pages=4)  # 3 usable pages of 4 positions
    a, b = _seq(0, 4), _seq(1, 4)
    sched.submit(a)
    sched.submit(b)
    _run(sched, sched.schedule())  # both prompts fill one page each; both sampled
    plan = sched.schedule()  # each decode needs a second page: only one is free
    assert [s.id for s, _ in plan.rows] == [0]
    assert sched.preemptions == 1 and list(sched.waiting) == [b] and b.computed == 0 and b.pages == []
    assert sched.pages.num_free == 3 - len(a.pages)


def test_finish_returns_everything_without_a_tenant():
    sched = _scheduler()
    a = _seq(0, 6)
    sched.submit(a)
    _run(sched, sched.schedule())
    sched.finish(a, "length")
    assert sched.pages.num_free == sched.pages.capacity and sched.slots.num_free == 4


def test_tenant_prefix_entry_is_reused_and_evicted_when_needed():
    sched = _scheduler()
    a = _seq(0, 6, tenant="t")
    sched.submit(a)
    _run(sched, sched.schedule())
    _run(sched, sched.schedule())
    sched.finish(a, "stop")  # computed 6 tokens: an entry with 2 pages and the slot
    assert len(sched.prefix) == 1 and sched.slots.num_free == 3
    b = Sequence(id=1, request=Request(tuple(a.tokens) + (9, 9), tenant="t"), tokens=a.tokens + [9, 9])
    sched.submit(b)
    plan = sched.schedule()
    assert b.computed == 6 and b.cached_tokens == 6 and [(s.id, n) for s, n in plan.rows] == [(1, 3)]
    assert plan.copy_slots and plan.copy_pages  # boundary page 6 // 4 copied, snapshot copied
    other = Sequence(id=2, request=Request(tuple(a.tokens) + (9,), tenant="u"), tokens=a.tokens + [9])
    sched.submit(other)
    sched.schedule()
    assert other.cached_tokens == 0  # another tenant never hits
