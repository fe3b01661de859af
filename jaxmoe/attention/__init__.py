"""The three attention kinds: MLA (DeepSeek-V3), DSA (DeepSeek-V3.2), KDA (Kimi Linear)."""

from jaxmoe.attention.delta_rule import chunked_delta_rule, recurrent_delta_rule
from jaxmoe.attention.dsa import DSA, Indexer
from jaxmoe.attention.kda import KDA, KDAState
from jaxmoe.attention.mla import MLA

__all__ = ["DSA", "KDA", "MLA", "Indexer", "KDAState", "chunked_delta_rule", "recurrent_delta_rule"]
