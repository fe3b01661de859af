"""Training data: the corpus (Python stdlib sources), token streams, packed batches.

The tokenizer they are encoded with is :class:`jaxmoe.chat.tokenizer.Tokenizer`.
"""

from jaxmoe.data.corpus import CORPUS_SOURCE, Document, python_stdlib_documents, split_documents
from jaxmoe.data.pipeline import PackedBatches, TokenData, build_token_data, heldout_batches

__all__ = [
    "CORPUS_SOURCE",
    "Document",
    "PackedBatches",
    "TokenData",
    "build_token_data",
    "heldout_batches",
    "python_stdlib_documents",
    "split_documents",
]
