"""Training data: the corpus (Python stdlib sources), a byte-level BPE tokenizer, packed batches."""

from jaxmoe.data.corpus import CORPUS_SOURCE, Document, python_stdlib_documents, split_documents
from jaxmoe.data.pipeline import PackedBatches, TokenData, build_token_data, heldout_batches
from jaxmoe.data.tokenizer import BPETokenizer

__all__ = [
    "BPETokenizer",
    "CORPUS_SOURCE",
    "Document",
    "PackedBatches",
    "TokenData",
    "build_token_data",
    "heldout_batches",
    "python_stdlib_documents",
    "split_documents",
]
