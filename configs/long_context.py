"""Long-context variant of the tiny model: ``dsa`` and ``kda`` layers in the target's proportion
(about 1:3, no ``mla``), a 1,048,576-token context, the sequence split over 8 ``context`` shards.

    python benchmarks/long_context.py --tokens 1048576

Dims are the tiny model's (``configs/tiny.py``); the indexer keeps the target's top-2,048 with two
16-wide heads (its score costs ``T^2 / 2`` dot products of ``2 x 16``: the term that dominates a
1M-token prefill), and KDA runs 64-token chunks.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import tiny  # noqa: E402


def get_config(arg=None):
    c = tiny.get_config(arg)
    c.name = "long_context"
    c.model.layer_kinds = ("kda", "kda", "kda", "dsa")
    c.model.max_context = 1048576
    c.model.indexer = dict(num_heads=2, head_dim=16, topk=2048)
    c.model.kda.chunk_size = 64
    c.mesh = dict(data=1, fsdp=1, expert=1, context=8, tensor=1)
    return c
