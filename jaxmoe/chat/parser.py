"""Output parsing: the model's token ids, one at a time, to reasoning, content and tool-call deltas.

The parser is a small state machine over token ids (the native markup's structural tokens are
single special ids, so it never looks at text to find structure)::

    THINK --<|/think|>--> CONTENT --<|tool_call|>--> NAME --<|tool_args|>--> ARGS --<|/tool_call|>--> CONTENT
    any state --<|end|> or <|endoftext|>--> DONE

It starts in THINK when the prompt opened the thinking block (``thinking=True``), else in CONTENT.
Text ids are detokenized incrementally per segment (the reasoning, the content between calls, each
call's arguments): a delta is emitted once a token's text is complete, and a token whose text ends
in U+FFFD (an incomplete UTF-8 sequence, more bytes to come) is held back until the next token
completes it or the segment ends. A special id out of place (``<|tool_args|>`` in content, a second
``<|think|>``) is dropped: markup never appears in the text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jaxmoe.chat.format import NATIVE, Markup
from jaxmoe.chat.tokenizer import Tokenizer

REASONING = "reasoning"
CONTENT = "content"
TOOL_CALL = "tool_call"
ARGUMENTS = "arguments"
DELTA_KINDS = (REASONING, CONTENT, TOOL_CALL, ARGUMENTS)

_THINK, _CONTENT, _NAME, _ARGS, _DONE = "think", "content", "name", "args", "done"


@dataclasses.dataclass(frozen=True)
class Delta:
    """One piece of parsed output.

    Attributes:
      kind: ``"reasoning"`` / ``"content"`` (``text`` is the new text), ``"tool_call"`` (a call
        starts: ``index``, ``name``), ``"arguments"`` (``text`` is the next fragment of call
        ``index``'s JSON arguments, verbatim).
      text: the new text (reasoning, content, arguments); "" for a tool_call.
      index: the tool call's position in the output (0, 1, ...); None for reasoning and content.
      name: the called tool's name (tool_call only).
    """

    kind: str
    text: str = ""
    index: int | None = None
    name: str | None = None


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str


@dataclasses.dataclass
class Parsed:
    """A whole output, parsed.

    Attributes:
      reasoning: the thinking text ("" when none).
      content: the answer text (text after a tool call included).
      tool_calls: the calls in order; ``arguments`` is the model's JSON text verbatim.
      reasoning_tokens: ids generated inside thinking, the closing token excluded.
    """

    reasoning: str
    content: str
    tool_calls: list[ParsedCall]
    reasoning_tokens: int


class _Detokenizer:
    """Incremental decoding of one text segment.

    Only a short window is re-decoded per token (the last emitted token as context plus the new
    ones), so a long segment costs linear time; a byte-level decoder makes the window's text a
    suffix of the segment's text, and the concatenated output equals ``decode(segment)``.
    """

    def __init__(self, tokenizer: Tokenizer):
        # The HF tokenizer's own decode: ``Tokenizer.decode`` re-checks every id, the parser already has.
        self._decode = tokenizer.hf.decode
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids[prefix:read] are context already emitted
        self._read = 0  # ids[:read] have been emitted

    def add(self, token_id: int) -> str:
        """Appends a text id; returns the text it completes ("" while held back)."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Ends the segment: returns the held-back text and starts a new segment."""
        out = self._emit(final=True)
        self._ids, self._prefix, self._read = [], 0, 0
        return out

    def _emit(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        context = self._decode(self._ids[self._prefix : self._read]) if self._read > self._prefix else ""
        text = self._decode(self._ids[self._prefix :])
        if not final and (text.endswith("\ufffd") or len(text) <= len(context)):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(context) :]


class OutputParser:
    """Incremental parser of one generated turn.

    Args:
      tokenizer: the model's tokenizer.
      markup: the chat format's structural tokens (each must be a token of ``tokenizer``).
      thinking: whether the prompt opened the thinking block (the output starts as reasoning).
    """

    def __init__(self, tokenizer: Tokenizer, markup: Markup = NATIVE, thinking: bool = True):
        # A format may lack thinking or tool-call tokens (an imported family's): None never matches.
        ids = {
            f: tokenizer.token_id(getattr(markup, f)) for f in ("think_close", "call_open", "call_args", "call_close")
        }
        if thinking and ids["think_close"] is None:
            raise ValueError(f"thinking: markup.think_close {markup.think_close!r} is not a token of the tokenizer")
        self._think_close, self._call_open = ids["think_close"], ids["call_open"]
        self._call_args, self._call_close = ids["call_args"], ids["call_close"]
        end = tokenizer.token_id(markup.end) if markup.end else None
        self._ends = {i for i in (end, tokenizer.eos_id, *tokenizer.stop_ids) if i is not None}
        self._vocab_size = tokenizer.vocab_size
        self._special = frozenset(tokenizer.special_ids) | {i for i in ids.values() if i is not None} | self._ends
        self._tokenizer = tokenizer
        self._state = _THINK if thinking else _CONTENT
        self._text = _Detokenizer(tokenizer)
        self._name_ids: list[int] = []
        self._calls = 0
        self.reasoning_tokens = 0

    @property
    def done(self) -> bool:
        """An end token was fed (or ``finish`` was called): further ids are ignored."""
        return self._state == _DONE

    def feed(self, token_id: int) -> list[Delta]:
        """Parses the next generated id; returns the deltas it completes (often one, maybe none)."""
        token_id = int(token_id)
        if self._state == _DONE:
            return []
        if self._state == _THINK and token_id != self._think_close and token_id not in self._ends:
            self.reasoning_tokens += 1
        if not 0 <= token_id < self._vocab_size:
            return []  # a padded model vocabulary's id, no token of the tokenizer: dropped
        if token_id not in self._special:
            if self._state == _NAME:
                self._name_ids.append(token_id)
                return []
            return self._text_delta(self._text.add(token_id))
        return self._on_special(token_id)

    def finish(self) -> list[Delta]:
        """Ends the output (at its end token or a length limit): returns the held-back deltas."""
        out = self._close_segment() if self._state != _DONE else []
        self._state = _DONE
        return out

    def _on_special(self, token_id: int) -> list[Delta]:
        state = self._state
        if token_id in self._ends:
            return self.finish()
        if state == _THINK and token_id == self._think_close:
            out, self._state = self._close_segment(), _CONTENT
        elif state == _CONTENT and token_id == self._call_open:
            out, self._state = self._close_segment(), _NAME
            self._name_ids = []
        elif state == _NAME and token_id in (self._call_args, self._call_close):
            out = self._close_segment()
            self._state = _ARGS if token_id == self._call_args else _CONTENT
        elif state == _ARGS and token_id == self._call_close:
            out, self._state = self._close_segment(), _CONTENT
        else:
            out = []  # markup out of place: dropped, never printed
        return out

    def _close_segment(self) -> list[Delta]:
        """Flushes the current segment; a call's name segment becomes its tool_call delta."""
        if self._state == _NAME:
            name = self._tokenizer.decode(self._name_ids).strip()
            self._calls += 1
            return [Delta(TOOL_CALL, index=self._calls - 1, name=name)]
        return self._text_delta(self._text.flush())

    def _text_delta(self, text: str) -> list[Delta]:
        if not text:
            return []
        if self._state == _THINK:
            return [Delta(REASONING, text)]
        if self._state == _ARGS:
            return [Delta(ARGUMENTS, text, index=self._calls - 1)]
        return [Delta(CONTENT, text)]


def collect(deltas: Iterable[Delta], reasoning_tokens: int = 0) -> Parsed:
    """The ``Parsed`` output that a stream of deltas adds up to."""
    reasoning, content, names, arguments = [], [], [], []
    for d in deltas:
        if d.kind == REASONING:
            reasoning.append(d.text)
        elif d.kind == CONTENT:
            content.append(d.text)
        elif d.kind == TOOL_CALL:
            names.append(d.name)
            arguments.append([])
        elif d.kind == ARGUMENTS:
            arguments[d.index].append(d.text)
    calls = [ParsedCall(name, "".join(args)) for name, args in zip(names, arguments, strict=True)]
    return Parsed("".join(reasoning), "".join(content), calls, reasoning_tokens)


def parse(token_ids: Iterable[int], tokenizer: Tokenizer, *, thinking: bool = True, markup: Markup = NATIVE) -> Parsed:
    """Parses a whole output (the ids generated after the prompt) with ``OutputParser``."""
    parser = OutputParser(tokenizer, markup=markup, thinking=thinking)
    deltas = [d for t in token_ids for d in parser.feed(t)]
    deltas += parser.finish()
    return collect(deltas, parser.reasoning_tokens)
