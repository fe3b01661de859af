"""The engine's program policy (``jaxmoe.inference.programs.Programs``) with a stand-in compile:
which shapes run on a cover, which get their own program, in what order the compiler thread takes
them, and the warm covers."""

import threading
import time

import pytest

from jaxmoe.inference.programs import Programs, Shape, warm_shapes


def _programs(**kw):
    compiled = []
    release = threading.Event()
    release.set()

    def compile(shape):
        release.wait()
        compiled.append(shape)
        return ("program", shape)

    return Programs(compile, background=True, **kw), compiled, release


def decode(rows, pages=16):
    return Shape(rows, 0, 0, pages, masked=True)


def test_a_shape_near_its_cover_compiles_only_once_met_compile_after_times():
    programs, compiled, _ = _programs(compile_after=3, max_padding=2.0)
    programs.warm([decode(16)])
    programs.wait()
    near = decode(8)  # its cover costs 2x: within max_padding
    for _ in range(2):
        assert programs.choose(near) == decode(16)
    programs.wait()
    assert near not in programs.ready and compiled == [decode(16)]
    assert programs.choose(near) == decode(16)  # the third time: queued
    programs.wait()
    assert compiled == [decode(16), near] and programs.choose(near) == near
    assert programs.padded_steps == 3


def test_a_shape_far_from_its_cover_compiles_at_once():
    programs, compiled, _ = _programs(compile_after=100, max_padding=2.0)
    programs.warm([decode(32)])
    programs.wait()
    far = decode(8)  # its cover costs 4x
    assert programs.choose(far) == decode(32)
    programs.wait()
    assert far in programs.ready and programs.choose(far) == far


def test_without_a_cover_the_step_compiles_itself_and_without_background_nothing_is_queued():
    programs, compiled, _ = _programs()
    assert programs.choose(decode(8)) == decode(8) and programs.compiling() == 0
    off = Programs(lambda shape: shape, background=False)
    assert off.warm([decode(8)]) == [] and off.compiling() == 0
    assert off.choose(decode(4)) == decode(4)


def test_warm_covers_go_first_in_order_then_the_most_padded_work():
    programs, compiled, release = _programs(compile_after=1, max_padding=1.0)
    programs.warm([decode(32, pages=64)])
    programs.wait()
    release.clear()  # hold the compiler thread on a first shape while the others queue up
    programs.choose(decode(8, pages=64))
    while programs._queued:
        time.sleep(0.01)
    small, large = decode(1, pages=64), decode(16, pages=64)
    programs.choose(small)  # pads 31 rows once
    for _ in range(3):
        programs.choose(large)  # pads 16 rows, three times: more padded work
    warm = [decode(4, pages=8), decode(2, pages=8)]
    programs.warm(warm)
    release.set()
    programs.wait()
    assert compiled == [decode(32, pages=64), decode(8, pages=64), *warm, large, small]


def test_forget_drops_the_programs_and_queues_the_warm_covers_again():
    programs, compiled, _ = _programs()
    covers = programs.warm([decode(8), decode(32)])
    assert covers == [decode(8), decode(32)]
    programs.wait()
    programs.forget()
    assert not programs.ready
    programs.wait()
    assert set(programs.ready) == set(covers) and compiled == covers * 2


def test_bad_policy_values_are_refused():
    with pytest.raises(ValueError, match="compile_after must be >= 1"):
        Programs(lambda s: s, background=True, compile_after=0)
    with pytest.raises(ValueError, match="max_padding >= 1"):
        Programs(lambda s: s, background=True, max_padding=0.5)


def test_warm_shapes_cover_every_step_of_their_widths():
    covers = warm_shapes(max_rows=8, max_chunk=32, floors={8: 8, 16: 4}, images=False)
    assert len(covers) == 2 * 4 + 1 and len(set(covers)) == len(covers)  # (8, 0, 0, 8) once
    for pages in (8, 16):
        for d in (0, 1, 2, 4, 8):
            for p, chunk in ((0, 0), (1, 8), (2, 32), (8, 16), (8, 32)):
                if d or p:
                    step = Shape(d, p, chunk, pages, masked=False)
                    assert any(c.covers(step) for c in covers), step
    assert not any(c.covers(Shape(1, 0, 0, 32, masked=False)) for c in covers)  # wider than warmed
    assert not any(c.covers(Shape(0, 1, 64, 8, masked=False)) for c in covers)  # a longer chunk than any step's
