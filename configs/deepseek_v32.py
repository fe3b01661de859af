"""DeepSeek-V3.2 (671B): DeepSeek-V3 with DSA (lightning indexer, top-2,048) in every layer.

jaxmoe info --config configs/deepseek_v32.py
"""

import pathlib
import sys

import ml_collections

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import deepseek_v3  # noqa: E402


def get_config(arg=None):
    del arg
    c = ml_collections.ConfigDict()
    c.name = "deepseek_v32"
    c.model = deepseek_v3.model(layer_kind="dsa")
    c.model.indexer = dict(num_heads=64, head_dim=128, topk=2048)
    c.mesh = dict(data=1, fsdp=8, expert=32, context=1, tensor=1)
    return c
