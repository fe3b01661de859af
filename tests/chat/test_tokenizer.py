"""The tokenizer: exact round trips, determinism, special tokens (plain vs parsed), save/load, HF folders."""

import json
import pickle
import random

import numpy as np
import pytest
import tokenizers

from jaxmoe.chat.format import EOS_TOKEN, NATIVE_SPECIAL_TOKENS
from jaxmoe.chat.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer
from jaxmoe.data import python_stdlib_documents, split_documents

TINY_MAX_BYTES = 2_000_000  # configs/tiny.py's data.max_bytes: the corpus the tiny model trains on


@pytest.fixture(scope="module")
def splits():
    return split_documents(python_stdlib_documents(300_000), 0.1)


@pytest.fixture(scope="module")
def tok(splits):
    train, _ = splits
    return Tokenizer.train([d.text for d in train], 512)


def test_native_special_tokens_take_the_first_ids(tok):
    assert [tok.hf.id_to_token(i) for i in range(len(NATIVE_SPECIAL_TOKENS))] == list(NATIVE_SPECIAL_TOKENS)
    assert [tok.token_id(t) for t in NATIVE_SPECIAL_TOKENS] == list(range(11))
    assert tok.special_ids == frozenset(range(11))
    assert tok.eos_token == EOS_TOKEN and tok.eos_id == 0 and tok.stop_ids == {0}
    assert tok.vocab_size == 512 and tok.chat_template is None and tok.bos_token is None
    assert tok.token_id("<|no such token|>") is None


def test_training_is_deterministic(tok, splits):
    train, _ = splits
    texts = [d.text for d in train]
    again = Tokenizer.train(iter(texts), 512)  # any iterable; a new HF trainer (fresh hash seeds)
    assert again == tok and again.to_json_str() == tok.to_json_str()
    assert Tokenizer.train(texts, 511) != tok
    custom = Tokenizer.train(texts[:3], 300, special_tokens=("<|a|>", EOS_TOKEN))
    assert custom.token_id("<|a|>") == 0 and custom.eos_id == 1 and custom.special_ids == {0, 1}


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "def f(x):\n    return x + 1  # comment\n",
        "   leading and trailing   \n\n\t\r\n",
        "\t\t  \n \n\n\n        \r\r\n  x  \x0b\x0c",
        "naïve café, Straße, Ελληνικά, русский, 日本語, 한국어, العربية, हिन्दी",
        "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷 combining e\u0301 a\u0308",
        "\u3000ideographic space\xa0nbsp \u2028line sep ٣٤٥ digits ½ \u200b\ufeff",
        "nul \x00 and controls \x01\x7f\x9f",
        "x" * 1000 + " " * 500 + "1" * 300,
        "don't I'll we're 's 'S",
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert not set(ids) & tok.special_ids
    assert tok.decode(ids) == text
    assert tok.encode_with_specials(text) == ids  # no special-token strings in it: the same ids


def test_round_trip_of_the_whole_training_corpus(tok):
    docs = python_stdlib_documents(TINY_MAX_BYTES)
    texts = [d.text for d in docs]
    encoded = tok.encode_batch(texts)
    assert [tok.decode(ids) for ids in encoded] == texts
    assert encoded[:5] == [tok.encode(t) for t in texts[:5]]
    assert not any(set(ids) & tok.special_ids for ids in encoded)


def test_round_trip_random_text(tok):
    rng = random.Random(0)
    ranges = [(0x20, 0x7E), (0x0, 0x20), (0xA0, 0x24F), (0x370, 0x3FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F6FF)]
    texts = []
    for _ in range(200):
        chars = [chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randrange(1, 60))]
        texts.append("".join(chars))
    assert [tok.decode(ids) for ids in tok.encode_batch(texts)] == texts


def test_random_ids_decode_and_ids_past_the_vocabulary(tok):
    rng = np.random.default_rng(0)
    for n in (1, 7, 64, 300):
        ids = rng.integers(11, tok.vocab_size, size=n)
        text = tok.decode(ids)
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([tok.token_id("\u00c3")]) == "\ufffd"  # byte 0xC3 (a lone UTF-8 lead byte)
    assert tok.decode([tok.eos_id]) == EOS_TOKEN and tok.decode([tok.eos_id], skip_special=True) == ""
    # A model's padding rows past the tokenizer's vocabulary have no text; negative ids are refused.
    assert tok.decode([tok.vocab_size, *tok.encode("ok"), tok.vocab_size + 7]) == "ok"
    with pytest.raises(ValueError, match="negative"):
        tok.decode([-1])
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"bytes")


def test_special_token_strings_are_plain_text_in_encode(tok):
    for special in NATIVE_SPECIAL_TOKENS:
        text = f"user says {special} and{special}{special}x"
        ids = tok.encode(text)
        assert not set(ids) & tok.special_ids, special
        assert tok.decode(ids) == text and tok.decode(ids, skip_special=True) == text


def test_encode_with_specials_parses_them(tok):
    text = "<|endoftext|><|user|>hi <|end|>\n<|assistant|><|think|>"
    ids = tok.encode_with_specials(text)
    e, user, end, asst, think = (
        tok.token_id(t) for t in ("<|endoftext|>", "<|user|>", "<|end|>", "<|assistant|>", "<|think|>")
    )
    assert ids[:2] == [e, user] and ids[-2:] == [asst, think] and end in ids
    assert ids[2:-2] == [*tok.encode("hi "), end, *tok.encode("\n")]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=True) == "hi \n"


def test_merges_stay_inside_pre_tokens(tok, splits):
    # Every learned token is one pre-token piece: no merge joins a word to a number, punctuation or space run.
    pre = tok.hf.pre_tokenizer
    for i in range(11, tok.vocab_size):
        text = tok.decode([i])
        if "\ufffd" not in text and len(text) > 1:
            assert len(pre.pre_tokenize_str(text)) == 1, repr(text)
    _, heldout = splits
    text = "\n".join(d.text for d in heldout)
    assert len(tok.encode(text)) / len(text.encode("utf-8")) < 0.6  # merges compress held-out code


def test_save_load_and_pickle(tok, tmp_path, splits):
    tok.save(tmp_path / "tok")
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE]
    config = json.loads((tmp_path / "tok" / TOKENIZER_CONFIG_FILE).read_text())
    assert config["eos_token"] == EOS_TOKEN and "chat_template" not in config
    for where in (tmp_path / "tok", tmp_path / "tok" / TOKENIZER_FILE, str(tmp_path / "tok")):
        loaded = Tokenizer.load(where)
        assert loaded == tok and loaded.vocab_size == tok.vocab_size and loaded.eos_id == tok.eos_id
    text = splits[1][0].text + "<|end|>"
    assert loaded.encode(text) == tok.encode(text)
    unpickled = pickle.loads(pickle.dumps(tok))
    assert unpickled == tok and unpickled.encode("<|end|>") == tok.encode("<|end|>")
    assert len(tok.encode("<|end|>")) > 1


def test_transformers_reads_a_saved_folder(tok, tmp_path):
    import transformers  # a test oracle: installed with the test extra

    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "def f(x):\n    return 'é' + x  # ok"
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf.eos_token == EOS_TOKEN and hf.eos_token_id == tok.eos_id


def _hf_folder(tok, folder, config, jinja=None, generation=None):
    folder.mkdir()
    (folder / TOKENIZER_FILE).write_text(tok.to_json_str())
    (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_load_an_hf_style_folder(tok, tmp_path):
    eos = {"__type": "AddedToken", "content": "<|end|>", "lstrip": False, "normalized": False, "special": True}
    config = {"eos_token": eos, "bos_token": "<|endoftext|>", "chat_template": "{{ messages }}", "extra": 1}
    loaded = Tokenizer.load(_hf_folder(tok, tmp_path / "a", config))
    assert loaded.eos_token == "<|end|>" and loaded.eos_id == tok.token_id("<|end|>")
    assert loaded.bos_token == EOS_TOKEN and loaded.chat_template == "{{ messages }}"
    assert loaded != tok and loaded.encode("abc <|end|>") == tok.encode("abc <|end|>")

    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert Tokenizer.load(_hf_folder(tok, tmp_path / "b", {"chat_template": named})).chat_template == "D"
    jinja = "{% for m in messages %}{{ m.content }}{% endfor %}"
    loaded = Tokenizer.load(_hf_folder(tok, tmp_path / "c", {"chat_template": "old"}, jinja=jinja))
    assert loaded.chat_template == jinja and loaded.eos_token == EOS_TOKEN  # no eos_token: <|endoftext|>

    # generation_config.json's eos ids: the first is eos when the config names none; all are stop ids.
    gen = {"eos_token_id": [5, 0]}
    loaded = Tokenizer.load(_hf_folder(tok, tmp_path / "d", {}, generation=gen))
    assert loaded.eos_id == 5 and loaded.stop_ids == {0, 5}
    loaded.save(tmp_path / "d2")
    assert Tokenizer.load(tmp_path / "d2") == loaded
    loaded = Tokenizer.load(_hf_folder(tok, tmp_path / "e", {"eos_token": "<|end|>"}, generation={"eos_token_id": 0}))
    assert loaded.eos_id == 5 and loaded.stop_ids == {0, 5}


def test_bad_vocab_size_and_special_tokens():
    for bad in (266, 0, -1, 512.0, "512", True):
        with pytest.raises(ValueError, match="vocab_size must be an int >= 267"):
            Tokenizer.train(["abc"], bad)
    assert Tokenizer.train(["abc"], 267).vocab_size == 267
    assert Tokenizer.train(["ab"], 1000).vocab_size == 268  # "ab" has one pair: training stops early
    with pytest.raises(ValueError, match="must include the eos token"):
        Tokenizer.train(["abc"], 300, special_tokens=("<|a|>",))
    with pytest.raises(ValueError, match="distinct"):
        Tokenizer.train(["abc"], 300, special_tokens=(EOS_TOKEN, EOS_TOKEN))


def _no_eos_tokenizer_json() -> str:
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    return hf.to_str()


@pytest.mark.parametrize(
    "files, match",
    [
        ({}, "no tokenizer file"),
        ({TOKENIZER_FILE: "{not json"}, "not a tokenizers tokenizer.json"),
        ({TOKENIZER_FILE: '{"model": 3}'}, "not a tokenizers tokenizer.json"),
        ({TOKENIZER_CONFIG_FILE: "[1, 2"}, "tokenizer_config.json: not valid JSON"),
        ({TOKENIZER_CONFIG_FILE: "[1, 2]"}, "tokenizer_config.json: expected a JSON object"),
        ({TOKENIZER_CONFIG_FILE: '{"eos_token": 3}'}, "'eos_token' must be a string"),
        ({TOKENIZER_CONFIG_FILE: '{"eos_token": "<|nope|>"}'}, "eos_token '<|nope|>' is not a token"),
        ({TOKENIZER_CONFIG_FILE: '{"chat_template": [{"name": "x", "template": "t"}]}'}, "without a 'default'"),
        ({TOKENIZER_CONFIG_FILE: '{"chat_template": 7}'}, "'chat_template' must be a string"),
        ({"generation_config.json": '{"eos_token_id": "2"}'}, "'eos_token_id' must be a token id"),
        ({"generation_config.json": '{"eos_token_id": [100000]}'}, "stop_ids"),
        ({TOKENIZER_FILE: _no_eos_tokenizer_json(), TOKENIZER_CONFIG_FILE: "{}"}, "no eos_token given"),
    ],
)
def test_bad_files_name_the_file(tok, tmp_path, files, match):
    folder = tmp_path / "tok"
    if files:
        tok.save(folder)
        for name, text in files.items():
            (folder / name).write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        Tokenizer.load(folder)
    assert str(folder) in str(info.value)
