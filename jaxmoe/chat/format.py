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
# An image's placeholder (one per merged patch): the native tokens and this one (id 11) are the
# special tokens of a model with a vision tower trained here (its vision.image_token_id).
IMAGE_TOKEN = "<|image|>"
VISION_SPECIAL_TOKENS = (*NATIVE_SPECIAL_TOKENS, IMAGE_TOKEN)


# Imported families mark thinking and tool calls with tokens of their own; those whose calls read
# NAME <args> ARGUMENTS <close> (DeepSeek V3.1's) parse like the native ones.
_THINK_TAGS = ("<think>", "</think>")
_DEEPSEEK_CALLS = (
    "<\uff5ctool\u2581call\u2581begin\uff5c>",
    "<\uff5ctool\u2581sep\uff5c>",
    "<\uff5ctool\u2581call\u2581end\uff5c>",
)


def markup_for(tokenizer) -> Markup:
    """The markup of ``tokenizer``'s chat format: native when it has the native tokens; otherwise
    the thinking tags and tool-call tokens of the imported family that it has ("" where none), with
    its eos token as the end of turn."""
    has = lambda tokens: all(tokenizer.token_id(t) is not None for t in tokens)
    if has(NATIVE.tokens):
        return NATIVE
    think = _THINK_TAGS if has(_THINK_TAGS) else ("", "")
    calls = _DEEPSEEK_CALLS if has(_DEEPSEEK_CALLS) else ("", "", "")
    return Markup(
        system="", user="", assistant="", tool="", end=tokenizer.eos_token,
        think_open=think[0], think_close=think[1], call_open=calls[0], call_args=calls[1], call_close=calls[2],
    )  # fmt: skip
