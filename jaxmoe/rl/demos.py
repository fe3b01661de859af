"""Demonstrations for the RL cold start: one reference answer per *training* prompt of each domain.

A model pretrained only on Python source has never seen a chat turn: it does not close a thinking
block, start an answer with ``{`` or end a turn, so every sample of a group scores the same 0 and
GRPO has nothing to compare (measured on the default tiny run: budget and tool_args scored 0 on
all 40 x 48 rollouts). As DeepSeek-R1's "cold start" does, ``jaxmoe rl`` can first fine-tune on a
few demonstrations of the answer format (``rl.sft``), then run GRPO from there.

The demonstrations come from the same sources as the prompts, never from held-out items:

- ``code``: the next lines of the real function the prefix was cut from, up to the first that
  makes the text a complete block (at most :data:`CODE_LINES`), so prefix + answer is the stdlib's
  own text; stopping there keeps most answers inside a rollout's ``max_tokens`` (three whole lines
  ran over 30 tokens in 69% of the training prompts, so the model never saw a code turn end);
- ``tool_args``: the required arguments filled with a typed example value
  (:func:`example_arguments`), checked against the tool's schema;
- ``budget``: a short written answer to each question (:data:`BUDGET_ANSWERS`).

Each answer follows an empty thinking block: the format is what is taught, the rewards (length of
thinking included) are left for GRPO to improve.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping

import jsonschema

from jaxmoe.rl import domains
from jaxmoe.rl.domains import Prompt

CODE_LINES = 3

# Short answers (the tiny model's turns are 32 tokens); keys are exactly domains.BUDGET_QUESTIONS.
BUDGET_ANSWERS = {
    "What does `zip` return?": "An iterator of tuples.",
    "What does `enumerate` return?": "Pairs of (index, item).",
    "What is the difference between a list and a tuple?": "A tuple is immutable.",
    "How do you reverse a list in Python?": "Use `xs[::-1]`.",
    "What does `len` do?": "It counts the items.",
    "What is a dictionary?": "A map of keys to values.",
    "How do you open a file for reading?": "Use `open(path)`.",
    "What does the `with` statement do?": "It runs a context manager.",
    "What is a generator?": "A lazy iterator.",
    "What does `yield` do?": "It returns a value and pauses.",
    "What is the difference between `is` and `==`?": "`is` compares identity.",
    "What does `None` mean?": "No value.",
    "How do you copy a list?": "Use `xs.copy()`.",
    "What does `sorted` return?": "A new sorted list.",
    "What does `str.join` do?": "It joins strings.",
    "What does `str.split` do?": "It splits a string.",
    "What is a lambda?": "An anonymous function.",
    "What does `range(3)` produce?": "0, 1 and 2.",
    "What is an exception?": "A raised error.",
    "How do you catch an exception?": "With `try` and `except`.",
    "What does `raise` do?": "It raises an exception.",
    "What is a class?": "A type of objects.",
    "What does `self` refer to in a method?": "The instance.",
    "What does `__init__` do?": "It sets up an instance.",
    "What is a module?": "A file of code.",
    "What does `import` do?": "It loads a module.",
    "What is a set?": "Unique items, unordered.",
    "How do you remove duplicates from a list?": "Use `set(xs)`.",
    "What does `map` return?": "An iterator.",
    "What does `filter` return?": "An iterator.",
    "What is a decorator?": "A function wrapper.",
    "What does `isinstance` check?": "An object's type.",
    "What is the difference between `append` and `extend`?": "`extend` adds many items.",
    "What does `dict.get` return for a missing key?": "`None`.",
    "What does `pass` do?": "Nothing.",
    "What is a list comprehension?": "`[f(x) for x in xs]`.",
    "What does `break` do in a loop?": "It exits the loop.",
    "What does `continue` do in a loop?": "It skips to the next pass.",
    "What is recursion?": "A function calling itself.",
    "What does `return` do without a value?": "It returns `None`.",
    "What is an f-string?": 'A formatted string: `f"{x}"`.',
    "What does `any` return for an empty list?": "`False`.",
}

_EXAMPLES = {"string": "a", "integer": 2, "number": 1.5, "boolean": True, "null": None}


def _example(schema: Mapping):
    """A value that ``schema`` (a parameter's schema from :func:`domains.tool_for`) accepts."""
    if "anyOf" in schema:
        return _example(schema["anyOf"][0])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = kind[0]
    if kind == "array":
        item = _example(schema.get("items", {"type": "integer"}))
        return [item, item]
    if kind in _EXAMPLES:
        return _EXAMPLES[kind]
    return 1  # an unconstrained parameter: any JSON value is allowed


def example_arguments(schema: Mapping) -> dict:
    """The required properties of an object ``schema``, each with an example value it accepts.

    Raises:
      ValueError: the result does not validate against ``schema`` (a schema this does not know).
    """
    args = {name: _example(schema["properties"][name]) for name in schema.get("required", ())}
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(args))
    if error is not None:
        raise ValueError(f"example arguments {args} do not validate against the schema: {error.message}")
    return args


@functools.cache
def _sources() -> dict[str, str]:
    """Training prefix -> the whole function it was cut from."""
    return {p: fn.source for fn in domains._code_pools()["train"] for p in fn.prefixes}


def _code_answer(prefix: str) -> str:
    source = _sources().get(prefix)
    if source is None:
        raise ValueError("code demonstration: the prefix is not one of the training functions' prefixes")
    answer = ""
    for line in source[len(prefix) :].splitlines(keepends=True)[:CODE_LINES]:
        answer += line
        if domains._compiles(prefix + answer) == 1.0:
            break
    return answer


def demonstration(prompt: Prompt) -> str:
    """The reference answer (content, no thinking) of a training prompt.

    Raises:
      ValueError: the prompt is not from a training pool (held-out items have no demonstration),
        or its domain has none.
    """
    if prompt.domain == "code":
        return _code_answer(prompt.data["prefix"])
    if prompt.domain == "tool_args":
        if prompt.data["name"] not in {t.name for t in domains.tools("train")}:
            raise ValueError(f"tool_args demonstration: {prompt.data['name']!r} is not a training tool")
        return json.dumps(example_arguments(prompt.data["schema"]))
    if prompt.domain == "budget":
        question = prompt.messages[-1]["content"]
        if domains._is_heldout(question, 4) or question not in BUDGET_ANSWERS:
            raise ValueError(f"budget demonstration: {question!r} is not a training question")
        return BUDGET_ANSWERS[question]
    raise ValueError(f"domain {prompt.domain!r} has no demonstrations; allowed: code, tool_args, budget")
