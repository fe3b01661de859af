"""The native chat format: its special tokens and the markup a conversation is rendered with.

    <|endoftext|><|system|>{system}<|end|><|user|>{text}<|end|>
    <|assistant|><|think|>{reasoning}<|/think|>{content}<|tool_call|>{name}<|tool_args|>{json}<|/tool_call|><|end|>
    <|tool|>{tool_call_id}\\n{result}<|end|> ... <|assistant|><|think|>

Every structural element is one special token, so a parser works on token ids and user text
(encoded without parsing specials) can never forge one. The model's turn ends at ``<|end|>``;
``<|endoftext|>`` (the training corpus' document separator) ends it too.
"""

from __future__ import annotations

import dataclasses

EOS_TOKEN = "<|endoftext|>"


@dataclasses.dataclass(frozen=True)
class Markup:
    """The structural token strings of a chat format."""

    system: str = "<|system|>"
    user: str = "<|user|>"
    assistant: str = "<|assistant|>"
    tool: str = "<|tool|>"
    end: str = "<|end|>"
    think_open: str = "<|think|>"
    think_close: str = "<|/think|>"
    call_open: str = "<|tool_call|>"
    call_args: str = "<|tool_args|>"
    call_close: str = "<|/tool_call|>"

    @property
    def tokens(self) -> tuple[str, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


NATIVE = Markup()
# The order fixes the ids a locally trained tokenizer gives them (0 .. 10).
NATIVE_SPECIAL_TOKENS = (EOS_TOKEN, *NATIVE.tokens)
