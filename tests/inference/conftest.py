"""The engine tests compile many programs (buckets x models x meshes): each module starts from an
empty compilation cache, so one module's executables do not pile up behind the next."""

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _fresh_compilation_cache():
    jax.clear_caches()
    yield
