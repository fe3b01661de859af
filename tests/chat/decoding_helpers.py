"""Shared by the grammar and decoding tests: a small trained tokenizer, schemas, adversarial models."""

import functools

import numpy as np

from jaxmoe.chat import grammar
from jaxmoe.chat.tokenizer import Tokenizer
from jaxmoe.data import python_stdlib_documents

EXTRA_VOCAB = 9  # the model's V is larger than the tokenizer's (padding): those ids must never come out


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer.train([d.text for d in python_stdlib_documents(200_000)], 512)


def model_vocab() -> int:
    return tokenizer().vocab_size + EXTRA_VOCAB


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "any length"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city"],
}
SEARCH = {  # nested objects and arrays, a long maxLength, minLength / minItems, a type list
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 2, "maxLength": 500},
        "flags": {"type": "array", "items": {"type": "boolean"}},
        "filter": {
            "type": "object",
            "properties": {
                "low": {"type": "number"},
                "high": {"type": "number", "maximum": 10.5},
                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            },
            "required": ["tags"],
            "additionalProperties": False,
        },
        "mode": {"enum": ["fast", "exact", None]},
        "limit": {"type": ["integer", "null"]},
    },
    "required": ["query", "filter"],
    "additionalProperties": False,
}
RECORDS = {  # everything required; arrays of objects; a bounded number; a non-ASCII key
    "type": "object",
    "properties": {
        "on": {"type": "boolean"},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "count": {"type": "integer"},
        "città": {"const": "Torino"},
        "rows": {
            "type": "array",
            "maxItems": 20,
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "label": {"type": "string", "maxLength": 5}},
                "required": ["id", "label"],
                "additionalProperties": False,
            },
        },
        "nothing": {"type": "null"},
    },
    "required": ["on", "ratio", "count", "città", "rows", "nothing"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "get_weather", "description": "Weather for a city.", "parameters": WEATHER},
    {"name": "search", "description": "Search.", "parameters": SEARCH},
    {"name": "records", "description": "Write records.", "parameters": RECORDS},
    {"name": "ping", "description": "No arguments."},
]
SCHEMAS = {"weather": WEATHER, "search": SEARCH, "records": RECORDS}


@functools.cache
def token_bytes() -> tuple[bytes, ...]:
    llg = grammar.llg_tokenizer(tokenizer())
    return tuple(llg.decode_bytes([i]) for i in range(tokenizer().vocab_size))


def _score(predicate) -> np.ndarray:
    """Per-token score ``[V]`` from the token's bytes."""
    return np.array([float(predicate(b)) for b in token_bytes()] + [0.0] * EXTRA_VOCAB)


@functools.cache
def preferences(kind: str) -> np.ndarray:
    """Static logits ``[V]`` of an adversarial model; a tiny noise breaks the ties per step.

    Every model also likes the ids it must never get: the padding ids and the markup that is never
    generated (``<|user|>`` ...), so a mask that let them through would be caught at once.
    """
    tok, v = tokenizer(), model_vocab()
    ids = {name: tok.token_id(s) for name, s in MARKUP.items()}
    logits = {
        "random": np.zeros(v),
        "whitespace": _score(lambda b: 10 * sum(c in b" \t\n\r" for c in b) + len(b)),
        "quotes": _score(lambda b: 10 * sum(c in b'"\\' for c in b) + len(b)),
        "longest": _score(lambda b: len(b) + 5 * sum(c >= 0x80 or c in b'"\\' for c in b)),
        "digits": _score(lambda b: 10 * sum(c in b"0123456789-.eE+" for c in b) + len(b)),
        "keep_thinking": _score(lambda b: len(b)),
        "end_now": np.zeros(v),
        "never_end": _score(lambda b: len(b)),
    }[kind].copy()
    if kind == "keep_thinking":
        logits[[ids["think_close"], ids["end"], ids["eos"]]] = -1e4
    elif kind == "end_now":
        logits[[ids["end"], ids["eos"]]] = 1e4
        logits[[ids["think_close"], ids["call_close"]]] = 5e3
    elif kind == "never_end":
        logits[[ids["think_close"], ids["end"], ids["eos"], ids["call_close"]]] = -1e4
        logits[ids["call_open"]] = 1e3
    forbidden = [ids["system"], ids["user"], ids["assistant"], ids["tool"], ids["think_open"]]
    logits[forbidden] = 2e4
    logits[tok.vocab_size :] = 3e4
    logits.flags.writeable = False
    return logits


MARKUP = {
    "eos": "<|endoftext|>",
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|tool|>",
    "end": "<|end|>",
    "think_open": "<|think|>",
    "think_close": "<|/think|>",
    "call_open": "<|tool_call|>",
    "call_args": "<|tool_args|>",
    "call_close": "<|/tool_call|>",
}
MODELS = ("random", "whitespace", "quotes", "longest", "digits", "keep_thinking", "end_now", "never_end")


def pick(mask: np.ndarray, logits: np.ndarray, rng: np.random.Generator) -> int:
    """The model's choice among the allowed tokens: greedy on its logits plus noise (the random model
    is all noise)."""
    noisy = logits + rng.normal(size=logits.shape) * 0.5
    return int(np.argmax(np.where(mask, noisy, -np.inf)))
