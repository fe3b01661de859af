"""Constrained decoding of one assistant turn: thinking budget, tool calls, JSON answers.

:class:`ChatDecoding` is the engine's ``Constraint`` (``jaxmoe.inference.constraint``) for a chat
request: a host-side state machine over the token ids the request generates. Phases:

    THINK -> CONTENT -> (CALL -> AFTER_CALL)* -> DONE

- THINK (thinking on: the prompt ends with ``think_open``): text tokens and ``think_close``; only
  ``think_close`` once ``thinking_budget`` reasoning tokens are spent, or when the tokens left
  must go to what follows (the reserve below). Never an end of turn.
- CONTENT: text and the end tokens (and ``call_open`` when tools may be called: tool_choice
  auto); a forced call (required, or a named tool) allows ``call_open`` only; a
  ``response_schema`` allows the JSON grammar (and ``call_open`` before it starts, in auto mode),
  then the end tokens.
- CALL: the llguidance grammar of ``NAME call_args JSON call_close``.
- AFTER_CALL: another ``call_open`` (auto / required) or the end tokens. DONE: end tokens only.

Completion guarantee: a grammar is compiled, when its phase starts, bounded to the tokens left
(less one for the end of turn; see ``grammar.bounded_schema``), and ``call_open`` is allowed only
when the smallest call still fits. For a forced call or a ``response_schema`` the thinking phase
ends early enough to leave a reserve: the worst case of the largest caps that fit half of
``max_tokens`` (or the smallest caps, when they do not). So the call or the JSON always completes
within ``max_tokens`` and validates against the original schema, whatever the model's logits.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import numpy as np

from jaxmoe.chat import grammar
from jaxmoe.chat.format import NATIVE, Markup

TOOL_CHOICES = ("auto", "none", "required", "{'name': NAME}")


class Phase(enum.Enum):
    THINK = "think"
    CONTENT = "content"
    CALL = "call"
    AFTER_CALL = "after_call"
    DONE = "done"


@dataclasses.dataclass(frozen=True)
class MarkupIds:
    """The ids of the markup tokens decoding needs; None where the tokenizer lacks one."""

    eos: int
    end: int | None
    think_close: int | None
    call_open: int | None
    call_args: int | None
    call_close: int | None
    think_open: int | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer, markup: Markup = NATIVE) -> MarkupIds:
        """Resolves ``markup``'s token strings through ``tokenizer`` (see ``grammar.token_tables``)."""
        tables = grammar.token_tables(tokenizer)
        ids = {
            f: tables.token_id(getattr(markup, f))
            for f in ("end", "think_close", "call_open", "call_args", "call_close", "think_open")
        }
        return cls(eos=tables.eos_id, **ids)

    @property
    def all_ids(self) -> tuple[int, ...]:
        """Every markup id the tokenizer has."""
        return tuple(i for i in dataclasses.astuple(self) if i is not None)

    @property
    def end_ids(self) -> tuple[int, ...]:
        """The tokens that end the turn."""
        return tuple(dict.fromkeys(i for i in (self.end, self.eos) if i is not None))


def _mode(tool_choice, names: Sequence[str]) -> tuple[str, str | None]:
    if isinstance(tool_choice, dict) and set(tool_choice) == {"name"}:
        if tool_choice["name"] not in names:
            raise ValueError(f"tool_choice.name: {tool_choice['name']!r} is not one of the tools {list(names)}")
        return "named", tool_choice["name"]
    if tool_choice not in ("auto", "none", "required"):
        raise ValueError(f"tool_choice: must be one of {TOOL_CHOICES}, got {tool_choice!r}")
    if tool_choice == "required" and not names:
        raise ValueError("tool_choice: 'required' needs tools")
    return tool_choice, None


class ChatDecoding:
    """The decoding constraint of one assistant turn (see the module docstring).

    Args:
      tokenizer: a ``jaxmoe.chat.tokenizer.Tokenizer`` (or a ``tokenizers.Tokenizer``).
      vocab_size: the model's V; ids at or above the tokenizer's vocabulary are never allowed.
      max_tokens: the most tokens the turn may generate (the end token included).
      thinking_budget: the most reasoning tokens; None: thinking is off (the prompt closed it).
      tools: ``{"name", "description", "parameters"}`` dicts.
      tool_choice: "auto", "none", "required" or ``{"name": NAME}``.
      response_schema: a JSON schema the answer must follow (OpenAI ``json_schema``), or None.
      ids: the markup token ids; default: ``MarkupIds.from_tokenizer(tokenizer)`` (native markup).

    Raises:
      ValueError: an argument is invalid (a schema outside the supported subset, an unknown tool,
        a missing markup token), or ``max_tokens`` cannot hold a forced call or the JSON answer.
    """

    def __init__(
        self,
        tokenizer,
        *,
        vocab_size: int,
        max_tokens: int,
        thinking_budget: int | None = None,
        tools: Sequence[dict] = (),
        tool_choice: str | dict = "auto",
        response_schema: dict | None = None,
        ids: MarkupIds | None = None,
    ):
        self._tables = grammar.token_tables(tokenizer)
        self._ids = ids if ids is not None else MarkupIds.from_tokenizer(tokenizer)
        if vocab_size < self._tables.vocab_size:
            raise ValueError(f"vocab_size: {vocab_size} < the tokenizer's {self._tables.vocab_size}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
        if thinking_budget is not None and thinking_budget < 0:
            raise ValueError(f"thinking_budget: must be >= 0 or None, got {thinking_budget}")
        if thinking_budget is not None and self._ids.think_close is None:
            raise ValueError("thinking_budget: the tokenizer has no think_close token")
        self._vocab, self._max_tokens, self._budget = vocab_size, max_tokens, thinking_budget
        self._tools, self._schema = list(tools), response_schema
        names = [grammar.tool_name(t, f"tools[{i}]") for i, t in enumerate(self._tools)]
        if len(set(names)) < len(names):
            raise ValueError(f"tools: names must be unique, got {names}")
        self._mode, self._name = _mode(tool_choice, names)
        # The tools that may be called, and the tokens of each one's smallest call (checks its schema).
        callable_floors = [
            grammar.tool_floor(t, path=f"tools[{i}]")
            for i, t in enumerate(self._tools)
            if self._mode != "none" and self._name in (None, names[i])
        ]
        if callable_floors and None in (self._ids.call_open, self._ids.call_args, self._ids.call_close):
            raise ValueError("tools: the tokenizer lacks the tool-call markup tokens")
        self._call_floor = min(callable_floors, default=None)  # name .. call_close, at the smallest caps
        if response_schema is not None:
            self._json_floor = grammar.schema_floor(response_schema, path="response_format.json_schema.schema")
        self._reserve = self._compute_reserve()
        self._generated = self._reasoning = 0
        self._phase = Phase.THINK if thinking_budget is not None else Phase.CONTENT
        self._matcher: grammar.Matcher | None = None
        self._json_started = False
        self._mask: np.ndarray | None = None
        if self._phase is Phase.CONTENT:
            self._start_content()

    @property
    def _forced(self) -> bool:
        return self._mode in ("required", "named")

    def _compute_reserve(self) -> int:
        """Tokens to keep after thinking: for the forced call or the JSON answer, and the end token."""
        avail = self._max_tokens - (self._budget is not None)  # less think_close
        if self._forced:
            need, floor = 2, self._call_floor  # call_open, end
            fit = lambda b: grammar.tool_call_grammar(self._tools, b, **self._call_ids, name=self._name)[1]
        elif self._schema is not None:
            need, floor = 1, self._json_floor
            fit = lambda b: grammar.json_grammar(self._schema, b)[1]
        else:
            return 1
        if need + floor > avail:
            what = "a forced tool call" if self._forced else "the response_format JSON"
            needed = need + floor + (avail < self._max_tokens)
            raise ValueError(f"max_tokens: {self._max_tokens} cannot hold {what} (it needs at least {needed})")
        target = (avail - need) // 2
        return need + (fit(target) if floor <= target else floor)

    @property
    def _call_ids(self) -> dict:
        return {"call_args": self._ids.call_args, "call_close": self._ids.call_close}

    @property
    def phase(self) -> Phase:
        """The current phase."""
        return self._phase

    @property
    def reasoning_tokens(self) -> int:
        """Tokens generated inside thinking (the closing token excluded)."""
        return self._reasoning

    @property
    def tokens_left(self) -> int:
        """Tokens the turn may still generate."""
        return self._max_tokens - self._generated

    def _start_content(self) -> None:
        self._phase = Phase.CONTENT
        if self._schema is not None and not self._forced:
            lark, _ = grammar.json_grammar(self._schema, self.tokens_left - 1)
            self._matcher = grammar.Matcher(self._tables, lark)

    def _start_call(self) -> None:
        self._phase = Phase.CALL
        lark, _ = grammar.tool_call_grammar(self._tools, self.tokens_left - 1, **self._call_ids, name=self._name)
        self._matcher = grammar.Matcher(self._tables, lark)

    def _call_fits(self) -> bool:
        """A call may open now: call_open, the smallest call, and the end token fit."""
        return self._call_floor is not None and 2 + self._call_floor <= self.tokens_left

    def _compute_allowed(self) -> np.ndarray:
        ids, v = self._ids, self._vocab
        # Text: every token but the markup (also markup a tokenizer does not mark special).
        mask = lambda extra, text=False: self._tables.mask(v, extra, text=text, not_text=ids.all_ids)
        if self._phase is Phase.THINK:
            may_think = self._reasoning < self._budget and self.tokens_left >= 2 + self._reserve
            return mask([ids.think_close], text=may_think)
        if self._phase is Phase.CALL:
            return self._matcher.allowed(v) & mask([ids.call_args, ids.call_close], text=True)
        if self._phase is Phase.DONE:
            return mask(ids.end_ids)
        if self._phase is Phase.AFTER_CALL:
            more = self._mode in ("auto", "required") and self._call_fits()
            return mask(ids.end_ids + ((ids.call_open,) if more else ()))
        # CONTENT
        if self._forced:
            return mask([ids.call_open])
        call = (ids.call_open,) if self._mode == "auto" and self._call_fits() and not self._json_started else ()
        if self._matcher is None:
            return mask(ids.end_ids + call, text=True)
        ends = ids.end_ids if self._matcher.accepting else ()
        return (self._matcher.allowed(v) & mask((), text=True)) | mask(ends + call)

    def allowed(self) -> np.ndarray:
        """Bool ``[vocab_size]`` of the tokens allowed next (read-only; never None)."""
        if self._mask is None:
            self._mask = self._compute_allowed()
        return self._mask

    def accept(self, token: int) -> None:
        """Records the token sampled and moves through the phases.

        Raises:
          ValueError: ``token`` was not allowed.
        """
        token = int(token)
        if not (0 <= token < self._vocab and self.allowed()[token]):
            raise ValueError(f"token {token} is not allowed in phase {self._phase.value}")
        self._mask = None
        self._generated += 1
        ids, phase = self._ids, self._phase
        if token in ids.end_ids and phase is not Phase.CALL:
            self._phase, self._matcher = Phase.DONE, None
        elif phase is Phase.THINK:
            if token == ids.think_close:
                self._start_content()
            else:
                self._reasoning += 1
        elif token == ids.call_open and phase in (Phase.CONTENT, Phase.AFTER_CALL):
            self._start_call()
        elif phase is Phase.CALL:
            self._matcher.accept(token)
            if self._matcher.done:
                self._phase, self._matcher = Phase.AFTER_CALL, None
        elif phase is Phase.CONTENT and self._matcher is not None:
            self._matcher.accept(token)
            self._json_started = True
            if self._matcher.done:
                self._phase, self._matcher = Phase.DONE, None
