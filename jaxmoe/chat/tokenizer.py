"""The tokenizer: Hugging Face ``tokenizers``, a byte-level BPE trained locally or an imported one.

A locally trained tokenizer (:meth:`Tokenizer.train`) is a byte-level BPE: text is cut by the GPT-2
pre-tokenisation regex (words, numbers, punctuation runs, whitespace runs; merges never cross their
boundaries), each piece is mapped to bytes, and the 256 bytes are always in the vocabulary, so every
string encodes and decodes back exactly. Its special tokens (by default the native chat format's,
:data:`jaxmoe.chat.format.NATIVE_SPECIAL_TOKENS`) take ids ``0 .. k-1`` in the given order; the eos
token ``<|endoftext|>`` (id 0) separates training documents.

On disk a tokenizer is a folder in the Hugging Face layout, so transformers' ``AutoTokenizer`` reads
what we write and we read what HF checkpoints ship:

    tokenizer.json          the tokenizers model (pre-tokenizer, BPE merges, added tokens)
    tokenizer_config.json   {"eos_token", "bos_token"?, "chat_template"?}
    chat_template.jinja     optional; when present it is the chat template (it wins over the config's)
    generation_config.json  optional; its "eos_token_id" (an int or a list) adds stop ids

Plain :meth:`Tokenizer.encode` never parses special-token strings in the text (user text cannot
forge a special id); :meth:`Tokenizer.encode_with_specials` does (prompts rendered by a template).
Neither adds BOS/EOS.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxmoe.chat.format import EOS_TOKEN, NATIVE_SPECIAL_TOKENS
from jaxmoe.paths import Path, resolve

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
# The files of a tokenizer folder that travel with a checkpoint (those present are copied).
TOKENIZER_FILES = (
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG_FILE,
)
_NUM_BYTES = 256


def _hf_copy(hf_json: str, *, parse_specials: bool) -> tokenizers.Tokenizer:
    """A fresh HF tokenizer from its JSON; ``encode_special_tokens`` is not serialised, so set it here."""
    tok = tokenizers.Tokenizer.from_str(hf_json)
    tok.encode_special_tokens = not parse_specials
    return tok


class Tokenizer:
    """A HF ``tokenizers`` tokenizer with its eos token and chat template.

    Attributes:
        hf: the HF tokenizer, set to encode special-token strings as plain text.
        eos_token: the end-of-sequence token string; ``eos_id`` its id.
        bos_token: the beginning-of-sequence token string of an imported tokenizer, or None.
        chat_template: the jinja chat template of an imported checkpoint; None for the native format.
        stop_ids: ids that end generation: ``eos_id`` and generation_config.json's eos ids.
        special_ids: ids of the special (added) tokens.
        vocab_size: one more than the largest id (added tokens included).
    """

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        eos_token: str,
        bos_token: str | None = None,
        chat_template: str | None = None,
        stop_ids: Iterable[int] = (),
    ):
        """Wraps ``hf``; ``eos_token`` (and ``bos_token`` if given) must be tokens of its vocabulary."""
        if not isinstance(hf, tokenizers.Tokenizer):
            raise TypeError(f"hf must be a tokenizers.Tokenizer, got {type(hf).__name__}")
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError(f"chat_template must be a str or None, got {type(chat_template).__name__}")
        self._json = hf.to_str()
        self.hf = _hf_copy(self._json, parse_specials=False)
        self._with_specials = _hf_copy(self._json, parse_specials=True)
        vocab = self.hf.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1
        for name, token in (("eos_token", eos_token), ("bos_token", bos_token)):
            if token is not None and (not isinstance(token, str) or token not in vocab):
                raise ValueError(f"{name} {token!r} is not a token of this tokenizer")
        self.eos_token = eos_token
        self.eos_id = vocab[eos_token]
        self.bos_token = bos_token
        self.chat_template = chat_template
        self.special_ids = frozenset(i for i, t in self.hf.get_added_tokens_decoder().items() if t.special)
        extra = [int(i) for i in stop_ids]
        if any(not 0 <= i < self.vocab_size for i in extra):
            raise ValueError(f"stop_ids {extra} must be token ids in [0, {self.vocab_size})")
        self.stop_ids = frozenset((self.eos_id, *extra))

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = NATIVE_SPECIAL_TOKENS
    ) -> Tokenizer:
        """Trains a byte-level BPE on ``texts``; the same tokenizer for the same arguments.

        Args:
            texts: training texts (e.g. documents); merges never cross text or pre-token boundaries.
            vocab_size: total vocabulary: special tokens + 256 bytes + merges (fewer merges if the
                texts run out of pairs); at least ``256 + len(special_tokens)``.
            special_tokens: distinct strings given ids ``0 .. k-1`` in order; must hold ``<|endoftext|>``
                (the eos token).

        Returns:
            The tokenizer, with eos ``<|endoftext|>`` and no chat template.
        """
        special_tokens = list(special_tokens)
        if EOS_TOKEN not in special_tokens:
            raise ValueError(f"special_tokens must include the eos token {EOS_TOKEN!r}, got {special_tokens}")
        if len(set(special_tokens)) != len(special_tokens) or not all(isinstance(t, str) and t for t in special_tokens):
            raise ValueError(f"special_tokens must be distinct non-empty strings, got {special_tokens}")
        least = _NUM_BYTES + len(special_tokens)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < least:
            raise ValueError(
                f"vocab_size must be an int >= {least} (256 bytes + {len(special_tokens)} special tokens), "
                f"got {vocab_size!r}"
            )
        hf = tokenizers.Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=special_tokens,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer)
        got = [hf.id_to_token(i) for i in range(len(special_tokens))]
        if got != special_tokens:  # the trainer puts them first; check rather than assume
            raise RuntimeError(f"special tokens got ids {got}, expected {special_tokens} at 0..{len(got) - 1}")
        return cls(hf, eos_token=EOS_TOKEN)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Reads a tokenizer folder (see the module docstring), or a ``tokenizer.json`` file.

        Given a file, the folder's other files are read beside it only if the file is named
        ``tokenizer.json``. The eos token is ``tokenizer_config.json``'s ``eos_token`` when given, else
        ``generation_config.json``'s first ``eos_token_id``, else ``<|endoftext|>`` if the vocabulary
        has it.

        Raises:
            ValueError: naming the file and what is wrong with it (missing, not JSON, not a
                tokenizers file, a field of the wrong type, an eos token not in the vocabulary).
        """
        path = resolve(path)
        if path.is_dir():
            folder, file = path, path / TOKENIZER_FILE
        else:
            folder, file = path.parent, path
        if not file.is_file():
            raise ValueError(f"{file}: no tokenizer file (expected {TOKENIZER_FILE} from Tokenizer.save or HF)")
        text = file.read_text(encoding="utf-8")
        try:
            json.loads(text)
            hf = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001  (tokenizers raises a bare Exception)
            raise ValueError(f"{file}: not a tokenizers tokenizer.json: {e}") from e
        siblings = file.name == TOKENIZER_FILE
        config = _read_json(folder / TOKENIZER_CONFIG_FILE) if siblings else {}
        gen_ids = _eos_ids(folder / GENERATION_CONFIG_FILE) if siblings else []
        vocab = hf.get_vocab(with_added_tokens=True)
        where = folder / TOKENIZER_CONFIG_FILE
        eos = _token_field(config, "eos_token", where)
        if eos is None and gen_ids:
            eos = hf.id_to_token(gen_ids[0])
            where = folder / GENERATION_CONFIG_FILE
        if eos is None and EOS_TOKEN in vocab:
            eos = EOS_TOKEN
        if eos is None:
            raise ValueError(
                f"{folder / TOKENIZER_CONFIG_FILE}: no eos_token given and {file} has no {EOS_TOKEN!r} token"
            )
        bos = _token_field(config, "bos_token", folder / TOKENIZER_CONFIG_FILE)
        for name, token in (("eos_token", eos), ("bos_token", bos)):
            if token is not None and token not in vocab:
                raise ValueError(f"{where}: {name} {token!r} is not a token of {file}")
        try:
            return cls(hf, eos_token=eos, bos_token=bos, chat_template=_chat_template(folder, config), stop_ids=gen_ids)
        except ValueError as e:
            raise ValueError(f"{folder}: {e}") from e

    def save(self, directory: str | os.PathLike) -> None:
        """Writes ``tokenizer.json`` and ``tokenizer_config.json`` (and ``generation_config.json`` when
        there are stop ids beyond eos) into ``directory`` (created if missing)."""
        directory = resolve(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / TOKENIZER_FILE).write_text(self._json, encoding="utf-8")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos_token}
        if self.bos_token is not None:
            config["bos_token"] = self.bos_token
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
        if self.stop_ids != {self.eos_id}:
            ids = [self.eos_id, *sorted(self.stop_ids - {self.eos_id})]
            (directory / GENERATION_CONFIG_FILE).write_text(json.dumps({"eos_token_id": ids}), encoding="utf-8")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it are encoded as plain text; no BOS/EOS."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects text: str, got {type(text).__name__}")
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text, in parallel (the fast path for training data)."""
        texts = list(texts)
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("encode_batch expects a sequence of str")
        return [e.ids for e in self.hf.encode_batch_fast(texts, add_special_tokens=False)]

    def encode_with_specials(self, text: str) -> list[int]:
        """Token ids of ``text`` where special-token strings become their ids (template-rendered prompts)."""
        if not isinstance(text, str):
            raise TypeError(f"encode_with_specials expects text: str, got {type(text).__name__}")
        return self._with_specials.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of ``ids``; bytes that are not valid UTF-8 become U+FFFD.

        Ids at or above ``vocab_size`` have no text (a model's vocabulary is often padded past its
        tokenizer's, and an unconstrained sampler can pick a padding row): they decode to nothing.

        Raises:
            ValueError: if an id is negative.
        """
        ids = [int(i) for i in ids]
        if any(i < 0 for i in ids):
            raise ValueError(f"decode: token id {min(ids)} is negative: ids must be >= 0")
        return self.hf.decode([i for i in ids if i < self.vocab_size], skip_special_tokens=skip_special)

    def token_id(self, token: str) -> int | None:
        """The id of the token string ``token`` (e.g. a special token), None if it has none."""
        return self.hf.token_to_id(token)

    def to_json_str(self) -> str:
        """The ``tokenizer.json`` text."""
        return self._json

    def _key(self) -> tuple:
        return (self._json, self.eos_token, self.bos_token, self.chat_template, self.stop_ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tokenizer):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self):
        # Pickle through the JSON: HF's own pickling drops ``encode_special_tokens``.
        extra = sorted(self.stop_ids - {self.eos_id})
        return (_rebuild, (self._json, self.eos_token, self.bos_token, self.chat_template, extra))

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_token={self.eos_token!r})"


def tokenizer_files(src: str | os.PathLike) -> list[tuple[Path, str]]:
    """``(file, name)`` of the :data:`TOKENIZER_FILES` present in ``src``: a tokenizer folder, or
    its ``tokenizer.json`` (the files beside it come too; a file of another name comes alone, as
    ``tokenizer.json``)."""
    src = resolve(src)
    if src.is_dir():
        pairs = [(src / name, name) for name in TOKENIZER_FILES]
    elif src.name == TOKENIZER_FILE:
        pairs = [(src.parent / name, name) for name in TOKENIZER_FILES]
    else:
        pairs = [(src, TOKENIZER_FILE)]
    return [(file, name) for file, name in pairs if file.is_file()]


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copies :func:`tokenizer_files` of ``src`` into the folder ``dst`` (local or a bucket; created
    if missing); returns the names of the files copied."""
    dst = resolve(dst)
    pairs = tokenizer_files(src)
    if pairs:
        dst.mkdir(parents=True, exist_ok=True)
    for file, name in pairs:
        (dst / name).write_bytes(file.read_bytes())
    return [name for _, name in pairs]


def _rebuild(hf_json, eos_token, bos_token, chat_template, stop_ids) -> Tokenizer:
    hf = tokenizers.Tokenizer.from_str(hf_json)
    return Tokenizer(hf, eos_token=eos_token, bos_token=bos_token, chat_template=chat_template, stop_ids=stop_ids)


def _read_json(file: Path) -> dict:
    """The JSON object in ``file``; ``{}`` if the file is absent."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_field(config: dict, name: str, file: Path) -> str | None:
    """``config[name]`` as a token string: HF writes a string or an ``{"content": ...}`` dict."""
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{file}: {name!r} must be a string or a {{'content': string}} dict, got {config[name]!r}")
    return value


def _eos_ids(file: Path) -> list[int]:
    """generation_config.json's ``eos_token_id`` (an int or a list of ints) as a list; [] if absent."""
    value = _read_json(file).get("eos_token_id")
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"{file}: 'eos_token_id' must be a token id or a non-empty list of them, got {value!r}")
    return ids


def _chat_template(folder: Path, config: dict) -> str | None:
    """chat_template.jinja if present, else tokenizer_config.json's chat_template (HF's named list: "default")."""
    jinja = folder / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    value = config.get("chat_template")
    file = folder / TOKENIZER_CONFIG_FILE
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{file}: 'chat_template' is a list without a 'default' entry (names: {sorted(named)})")
        value = named["default"]
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{file}: 'chat_template' must be a string or a list of {{name, template}}, got {value!r}")
    return value


__all__ = [
    "CHAT_TEMPLATE_FILE",
    "GENERATION_CONFIG_FILE",
    "SPECIAL_TOKENS_MAP_FILE",
    "TOKENIZER_CONFIG_FILE",
    "TOKENIZER_FILE",
    "TOKENIZER_FILES",
    "Tokenizer",
    "copy_tokenizer_files",
]
