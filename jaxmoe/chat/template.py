"""Prompt rendering: a conversation (internal message dicts) to the token ids the model reads.

The native format (see ``jaxmoe.chat.format``) is rendered at token level: every structural
element is placed as its special id and every text segment goes through ``Tokenizer.encode``, which
never parses special-token strings, so no user, tool or model text can forge markup::

    <|endoftext|><|system|>{system}[\\n\\n# Tools\\n{tool JSON, one per line}]<|end|>
    <|user|>{text}<|end|>
    <|assistant|><|think|>{reasoning}<|/think|>{content}
        [<|tool_call|>{name}<|tool_args|>{arguments}<|/tool_call|>]*<|end|>
    <|tool|>{tool_call_id}\\n{result}<|end|> ... <|assistant|><|think|>[<|/think|>]

An imported checkpoint that ships a jinja chat template (``tokenizer.chat_template``) is rendered
the way ``transformers``' ``apply_chat_template(..., sanitize_control_tokens=True)`` does it (same
sandboxed environment, filters and globals, messages and tools in the OpenAI form HF templates
expect), then encoded with the special tokens the template wrote parsed, while a control token
inside a message's or tool's own strings is encoded as plain text.

Messages are the internal form the API layers build (OpenAI-like)::

    {"role": "system" | "user", "content": str}
    {"role": "assistant", "content": str | None, "reasoning": str | None,
     "tool_calls": [{"id": str, "name": str, "arguments": str (JSON text)}]}
    {"role": "tool", "tool_call_id": str, "content": str}

``content`` may also be a list of ``{"type": "text", "text": str}`` parts (joined with newlines);
a user's list may hold ``{"type": "image", "tokens": n}`` parts too: an image already preprocessed,
rendered as ``n`` placeholders (``<|image|>``, the model's ``vision.image_token_id``) where it stands.
A jinja template gets each as an HF ``{"type": "image"}`` part and writes the image token once per
image (as Kimi K2.5's does, ``<|media_pad|>``); each is expanded to the image's ``n`` placeholders,
as the family's processor does it.
Earlier turns' reasoning and every tool result are rendered back in full, in order.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from jaxmoe.chat.format import EOS_TOKEN, IMAGE_TOKEN, NATIVE, Markup
from jaxmoe.chat.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
_TOOLS_HEADER = "# Tools\n"


def render(
    messages: Sequence[dict],
    tokenizer: Tokenizer,
    *,
    tools: Sequence[dict] | None = None,
    thinking: bool = True,
    markup: Markup = NATIVE,
    image_token_id: int | None = None,
) -> list[int]:
    """The prompt token ids of a conversation, ending with the assistant's generation prompt.

    Args:
      messages: the conversation, internal message dicts (module docstring).
      tokenizer: the model's tokenizer; its ``chat_template``, when set, is used instead of the
        native format.
      tools: the tools the model may call, each ``{"name", "description", "parameters"}`` (or the
        OpenAI ``{"type": "function", "function": {...}}`` form).
      thinking: True: the prompt opens the thinking block (``<|assistant|><|think|>``); False: it
        opens and closes it (``<|assistant|><|think|><|/think|>``). A jinja template receives it as
        ``enable_thinking``.
      markup: the structural tokens of the native format.
      image_token_id: the model's image placeholder id (``vision.image_token_id``); a jinja
        template's conversation with images needs it (the native format uses ``<|image|>``).

    Returns:
      The token ids, ``list[int]``.

    Raises:
      ValueError: a message or tool is malformed (the error names ``messages[i].field``), or the
        chat template refused the conversation (its ``raise_exception``, a sandbox refusal).
    """
    messages = [_checked(i, m) for i, m in enumerate(messages)]
    tools = [_tool_function(i, t) for i, t in enumerate(tools or ())]
    if tokenizer.chat_template is not None:
        return _render_jinja(messages, tokenizer, tools=tools, thinking=thinking, image_token_id=image_token_id)
    return _render_native(messages, tokenizer, tools=tools, thinking=thinking, markup=markup)


def render_text(
    messages: Sequence[dict],
    tokenizer: Tokenizer,
    *,
    tools: Sequence[dict] | None = None,
    thinking: bool = True,
    markup: Markup = NATIVE,
) -> str:
    """``render``'s ids decoded with the special tokens kept (for display and tests)."""
    ids = render(messages, tokenizer, tools=tools, thinking=thinking, markup=markup)
    return tokenizer.decode(ids, skip_special=False)


# ---------------------------------------------------------------------------------------------
# Validation: one normalised dict per message, errors naming the field and what is allowed.


def _image_part(part: dict, field: str) -> int:
    """The placeholder count of an ``{"type": "image", "tokens": n}`` part."""
    n = part.get("tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{field}.tokens is {n!r}; allowed: a positive int (the image's merged tokens)")
    return n


def _user_parts(value: Any, field: str) -> list[str | int] | None:
    """A user content list with image parts as ``[text | placeholder count, ...]`` in order
    (consecutive texts joined with newlines); None when it holds no image."""
    if not isinstance(value, list) or not any(isinstance(p, dict) and p.get("type") == "image" for p in value):
        return None
    out: list[str | int] = []
    for j, part in enumerate(value):
        if isinstance(part, dict) and part.get("type") == "image":
            out.append(_image_part(part, f"{field}[{j}]"))
        elif out and isinstance(out[-1], str):
            out[-1] += "\n" + _text_part(part, f"{field}[{j}]")
        else:
            out.append(_text_part(part, f"{field}[{j}]"))
    return out


def _text_part(part: Any, field: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise ValueError(f"{field} is {kind!r}; allowed: a {{'type': 'text', 'text': str}} part")
    if not isinstance(part.get("text"), str):
        raise ValueError(f"{field}.text must be a str, got {type(part.get('text')).__name__}")
    return part["text"]


def _text(value: Any, field: str, *, optional: bool = False) -> str:
    """A content value as one string: a str, or a list of text parts joined with newlines."""
    if value is None and optional:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(_text_part(part, f"{field}[{j}]") for j, part in enumerate(value))
    allowed = "a str, None or a list of text parts" if optional else "a str or a list of text parts"
    raise ValueError(f"{field} is {type(value).__name__}; allowed: {allowed}")


def _checked_call(field: str, call: Any) -> dict:
    if not isinstance(call, dict):
        raise ValueError(f"{field} is {type(call).__name__}; allowed: a dict with name and arguments")
    for key in ("name", "arguments"):
        if not isinstance(call.get(key), str):
            got = type(call.get(key)).__name__
            raise ValueError(
                f"{field}.{key} is {got}; allowed: a str ({'JSON text' if key == 'arguments' else 'the tool name'})"
            )
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise ValueError(f"{field}.id is {type(call['id']).__name__}; allowed: a str or None")
    return {"id": call.get("id"), "name": call["name"], "arguments": call["arguments"]}


def _checked(i: int, message: Any) -> dict:
    """``messages[i]`` validated and normalised: content a str, reasoning a str or None."""
    if not isinstance(message, dict):
        raise ValueError(f"messages[{i}] is {type(message).__name__}; allowed: a dict with role and content")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"messages[{i}].role is {role!r}; allowed: {', '.join(ROLES)}")
    content = message.get("content")
    parts = _user_parts(content, f"messages[{i}].content") if role == "user" else None
    if parts is not None:
        text = "\n".join(p for p in parts if isinstance(p, str))
        out = {"role": role, "content": text, "parts": parts}
    else:
        out = {"role": role, "content": _text(content, f"messages[{i}].content", optional=role == "assistant")}
    calls = message.get("tool_calls")
    if role == "assistant":
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"messages[{i}].reasoning is {type(reasoning).__name__}; allowed: a str or None")
        if calls is not None and not isinstance(calls, list):
            raise ValueError(f"messages[{i}].tool_calls is {type(calls).__name__}; allowed: a list of calls")
        out["reasoning"] = reasoning
        out["tool_calls"] = [_checked_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(calls or ())]
    elif calls:
        raise ValueError(f"messages[{i}].tool_calls is set on role {role!r}; allowed: only on role 'assistant'")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise ValueError(
                f"messages[{i}].tool_call_id is {type(call_id).__name__}; allowed: a str (required for role 'tool')"
            )
        out["tool_call_id"] = call_id
    return out


def _tool_function(i: int, tool: Any) -> dict:
    """``tools[i]``'s function dict, the OpenAI ``{"type": "function", "function": ...}`` wrapper removed."""
    if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict):
        tool = tool["function"]
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise ValueError(f"tools[{i}] must be a dict with a str name (and description, parameters)")
    return tool


# ---------------------------------------------------------------------------------------------
# The native format.


def _system_text(messages: list[dict], tools: list[dict]) -> str | None:
    """The system turn's text: every system message in order, then the tools; None: no turn."""
    parts = [m["content"] for m in messages if m["role"] == "system"]
    if tools:
        no_parameters = {"type": "object", "properties": {}}
        shown = [
            {
                "name": t["name"],
                "description": t.get("description") or "",
                "parameters": t.get("parameters") or no_parameters,
            }
            for t in tools
        ]
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in shown)
        parts.append(_TOOLS_HEADER + lines)
    return "\n\n".join(parts) if parts else None


def _render_native(messages: list[dict], tokenizer: Tokenizer, *, tools, thinking: bool, markup: Markup) -> list[int]:
    sid = _markup_ids(tokenizer, markup)
    ids = [sid[EOS_TOKEN]]
    system = _system_text(messages, tools)
    if system is not None:
        ids += [sid[markup.system], *tokenizer.encode(system), sid[markup.end]]
    for m in messages:
        if m["role"] == "user":
            ids += [sid[markup.user], *_user_ids(m, tokenizer), sid[markup.end]]
        elif m["role"] == "tool":
            text = f"{m['tool_call_id']}\n{m['content']}"
            ids += [sid[markup.tool], *tokenizer.encode(text), sid[markup.end]]
        elif m["role"] == "assistant":
            ids += [sid[markup.assistant], sid[markup.think_open], *tokenizer.encode(m["reasoning"] or "")]
            ids += [sid[markup.think_close], *tokenizer.encode(m["content"])]
            for call in m["tool_calls"]:
                ids += [sid[markup.call_open], *tokenizer.encode(call["name"]), sid[markup.call_args]]
                ids += [*tokenizer.encode(call["arguments"]), sid[markup.call_close]]
            ids.append(sid[markup.end])
    ids += [sid[markup.assistant], sid[markup.think_open]]
    if not thinking:
        ids.append(sid[markup.think_close])
    return ids


def _user_ids(message: dict, tokenizer: Tokenizer) -> list[int]:
    """A user turn's ids: its text, and each image as its placeholders (``IMAGE_TOKEN`` x tokens)."""
    if "parts" not in message:
        return tokenizer.encode(message["content"])
    image = tokenizer.token_id(IMAGE_TOKEN)
    if image is None:
        raise ValueError(f"the conversation holds images, but this model's tokenizer has no {IMAGE_TOKEN!r} token")
    ids = []
    for part in message["parts"]:
        ids += [image] * part if isinstance(part, int) else tokenizer.encode(part)
    return ids


def _markup_ids(tokenizer: Tokenizer, markup: Markup) -> dict[str, int]:
    """Token string -> id of every markup token and the EOS token; ValueError naming a missing one."""
    out = {}
    for token in (EOS_TOKEN, *markup.tokens):
        token_id = tokenizer.token_id(token)
        if token_id is None:
            raise ValueError(
                f"tokenizer has no token {token!r}; the native chat format needs all of {(EOS_TOKEN, *markup.tokens)}"
            )
        out[token] = token_id
    return out


# ---------------------------------------------------------------------------------------------
# An imported checkpoint's jinja template, rendered like transformers' apply_chat_template (with
# its sanitize_control_tokens=True): the same sandbox, filters and globals, messages in HF's OpenAI
# form, and the control tokens found in the conversation's own strings encoded as plain text.

# Private-use characters (HF's) wrapped around control tokens in the inputs, so that the rendered
# text tells them apart from the control tokens the template writes itself.
_MARK_START, _MARK_END = "\U000f0000", "\U000f0001"


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (HF marks assistant spans with it)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _TemplateDict:
    """The template's ``dict``: builds dicts, exposes nothing else of the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """The template's ``namespace``: refuses underscore-prefixed attributes (CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]  # Jinja's signature trick: `namespace(self=...)` still works
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template namespace cannot hold {name!r} (underscore-prefixed)"
            )


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; HF's (which templates are written against) does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def _compiled(chat_template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(), namespace=_TemplateNamespace
    )
    return env.from_string(chat_template)


@functools.lru_cache(maxsize=16)
def _template_literals(chat_template: str) -> str:
    """The template's literal text and string constants, NUL-joined (no match spans two of them)."""
    tree = _compiled(chat_template).environment.parse(chat_template)
    literals = {node.data for node in tree.find_all(jinja2.nodes.TemplateData)}
    literals |= {node.value for node in tree.find_all(jinja2.nodes.Const) if isinstance(node.value, str)}
    return "\0".join(literals)


@functools.lru_cache(maxsize=16)
def _pattern(tokens: tuple[str, ...]) -> re.Pattern:
    """Matches any of ``tokens``, longest first (a token wins over the tokens it contains)."""
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) or "(?!)")


def _control_tokens(tokenizer: Tokenizer) -> tuple[str, ...]:
    """HF's control tokens: every special added token, and the other added tokens the template writes."""
    literals = _template_literals(tokenizer.chat_template)
    added = tokenizer.hf.get_added_tokens_decoder().values()
    return tuple(t.content for t in added if t.special or (t.content in literals and not t.content.isspace()))


def _marked(value: Any, pattern: re.Pattern) -> Any:
    """``value`` with every control token in its strings wrapped in the markers (dict keys untouched)."""
    if isinstance(value, str):
        value = value.replace(_MARK_START, "").replace(_MARK_END, "")  # no forged markers
        return pattern.sub(f"{_MARK_START}\\g<0>{_MARK_END}", value)
    if isinstance(value, dict):
        return {k: _marked(v, pattern) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_marked(v, pattern) for v in value]
    return value


def _encode_plain(tokenizer: Tokenizer, text: str) -> list[int]:
    """``text``'s ids with no added token matched, special or not (``encode`` still matches the
    non-special ones, such as Qwen's ``<think>``): the pipeline run without the added vocabulary."""
    hf = tokenizer.hf
    if hf.normalizer is not None:
        text = hf.normalizer.normalize_str(text)
    splits = [piece for piece, _ in hf.pre_tokenizer.pre_tokenize_str(text)] if hf.pre_tokenizer else [text]
    return [token.id for piece in splits for token in hf.model.tokenize(piece)]


def _encode_marked(tokenizer: Tokenizer, text: str) -> list[int]:
    """Encodes a rendered chat: marked control tokens as plain text, the rest with specials parsed."""
    added = tuple(t.content for t in tokenizer.hf.get_added_tokens_decoder().values())
    markers = re.compile(f"{_MARK_START}({_pattern(added).pattern}){_MARK_END}|[{_MARK_START}{_MARK_END}]")
    pieces = markers.split(text)  # [text, marked token or None (a lone marker), text, ...]
    if len(pieces) == 1:
        return tokenizer.encode_with_specials(text)
    newline = tokenizer.encode("\n")
    ids = tokenizer.encode_with_specials(pieces[0])
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue
        as_text = i % 2 == 1
        encode = functools.partial(_encode_plain, tokenizer) if as_text else tokenizer.encode_with_specials
        # After a newline, as HF does it: a SentencePiece tokenizer adds no prefix space there.
        piece_ids = encode("\n" + piece)
        piece_ids = piece_ids[len(newline) :] if piece_ids[: len(newline)] == newline else encode(piece)
        if as_text and tokenizer.token_id(piece) in piece_ids:
            raise ValueError(
                f"cannot encode the control token {piece!r} as text: its plain-text encoding is the token itself"
            )
        ids += piece_ids
    return ids


def hf_messages(messages: Sequence[dict]) -> list[dict]:
    """Internal messages in the OpenAI form HF chat templates read (``render`` validates them first).

    Assistant tool calls become ``{"id", "type": "function", "function": {"name", "arguments"}}``
    with the arguments parsed from their JSON text; reasoning is carried as ``reasoning_content``
    (and ``thinking``, which gpt-oss templates read), as HF's apply_chat_template aliases it.
    """
    return _hf_form([_checked(i, m) for i, m in enumerate(messages)])


def _hf_form(checked: list[dict]) -> list[dict]:
    """:func:`hf_messages` of messages already checked (checking twice would lose the image parts)."""
    out = []
    for i, m in enumerate(checked):
        hf = {"role": m["role"], "content": m["content"]}
        if "parts" in m:
            hf["content"] = [
                {"type": "image"} if isinstance(p, int) else {"type": "text", "text": p} for p in m["parts"]
            ]
        if m["role"] == "assistant":
            if m["reasoning"] is not None:
                hf = {"thinking": m["reasoning"], **hf, "reasoning_content": m["reasoning"]}
            if m["tool_calls"]:
                hf["tool_calls"] = [
                    _hf_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(m["tool_calls"])
                ]
        elif m["role"] == "tool":
            hf["tool_call_id"] = m["tool_call_id"]
        out.append(hf)
    return out


def _hf_call(field: str, call: dict) -> dict:
    try:
        arguments = json.loads(call["arguments"])
    except json.JSONDecodeError as e:
        raise ValueError(f"{field}.arguments is not JSON ({e}); allowed: the JSON text of an object") from None
    call_id = {"id": call["id"]} if call["id"] is not None else {}
    return {**call_id, "type": "function", "function": {"name": call["name"], "arguments": arguments}}


def _render_jinja(
    messages: list[dict], tokenizer: Tokenizer, *, tools: list[dict], thinking: bool, image_token_id: int | None
) -> list[int]:
    pattern = _pattern(_control_tokens(tokenizer))
    kwargs = {"enable_thinking": thinking}
    if tokenizer.bos_token is not None:
        kwargs["bos_token"] = tokenizer.bos_token
    kwargs["eos_token"] = tokenizer.eos_token
    compiled = _compiled(tokenizer.chat_template)
    try:
        text = compiled.render(
            messages=_marked(_hf_form(messages), pattern),
            tools=_marked([{"type": "function", "function": t} for t in tools], pattern) or None,
            documents=None,
            add_generation_prompt=True,
            **kwargs,
        )
    except jinja2.TemplateError as e:  # raise_exception(...) or a sandbox refusal: the conversation's fault
        raise ValueError(f"the chat template refused the conversation: {e}") from e
    ids = _encode_marked(tokenizer, text)
    counts = [p for m in messages for p in m.get("parts", ()) if isinstance(p, int)]
    return _expand_images(ids, counts, image_token_id) if counts else ids


def _expand_images(ids: list[int], counts: list[int], image_token_id: int | None) -> list[int]:
    """``ids`` with the template's one image token per image expanded to each image's ``counts``."""
    if image_token_id is None:
        raise ValueError("the conversation holds images, but no image_token_id was given for the chat template")
    at = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(at) != len(counts):
        raise ValueError(
            f"the chat template wrote {len(at)} image tokens (id {image_token_id}) for the conversation's "
            f"{len(counts)} images; it must write one per image"
        )
    out, prev = [], 0
    for i, n in zip(at, counts, strict=True):
        out += ids[prev:i] + [image_token_id] * n
        prev = i + 1
    return out + ids[prev:]
