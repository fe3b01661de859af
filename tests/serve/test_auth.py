"""API keys: the keys file and ``JAXMOE_API_KEYS``, both header styles, constant-time comparison."""

import hashlib
import hmac

import pytest

from jaxmoe.serve import auth
from jaxmoe.serve.auth import ANONYMOUS, KeyChecker, load_api_keys, tenant_id


def write(tmp_path, text):
    path = tmp_path / "keys.txt"
    path.write_text(text)
    return str(path)


def test_keys_file_skips_comments_and_blanks_and_strips(tmp_path):
    path = write(tmp_path, "# team keys\n\n  sk-alpha  \n\t# indented comment\nsk-beta\n   \n")
    assert load_api_keys(path, env={}) == {"sk-alpha": tenant_id("sk-alpha"), "sk-beta": tenant_id("sk-beta")}


def test_env_keys_add_to_the_file(tmp_path):
    path = write(tmp_path, "sk-file\n")
    keys = load_api_keys(path, env={"JAXMOE_API_KEYS": " sk-env1 , sk-env2,"})
    assert sorted(keys) == ["sk-env1", "sk-env2", "sk-file"]
    assert sorted(load_api_keys(None, env={"JAXMOE_API_KEYS": "sk-env1"})) == ["sk-env1"]


def test_no_source_turns_auth_off():
    assert load_api_keys(None, env={}) is None
    assert load_api_keys(None, env={"JAXMOE_API_KEYS": "  "}) is None


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n  # another\n"])
def test_keys_file_without_keys_is_refused(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match="keys.txt.*no key"):
        load_api_keys(path, env={})


def test_missing_keys_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="absent.txt"):
        load_api_keys(str(tmp_path / "absent.txt"), env={})


def test_bad_keys_are_refused_without_echoing_them(tmp_path):
    with pytest.raises(ValueError, match="line 2") as e:
        load_api_keys(write(tmp_path, "sk-ok\nsk bad\n"), env={})
    assert "sk bad" not in str(e.value)
    with pytest.raises(ValueError, match="JAXMOE_API_KEYS"):
        load_api_keys(None, env={"JAXMOE_API_KEYS": ",,"})
    with pytest.raises(ValueError, match="JAXMOE_API_KEYS"):
        load_api_keys(None, env={"JAXMOE_API_KEYS": "sk-\u00e9"})


def test_tenant_is_stable_and_does_not_reveal_the_key():
    t = tenant_id("sk-secret")
    assert t == "key-" + hashlib.sha256(b"sk-secret").hexdigest()[:16]
    assert t == tenant_id("sk-secret") != tenant_id("sk-secret2")
    assert "secret" not in t


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": "Bearer sk-beta"},
        {"authorization": "bearer   sk-beta "},
        {"AUTHORIZATION": "BEARER sk-beta"},
        {"x-api-key": "sk-beta"},
        {"X-Api-Key": " sk-beta"},
        {"Authorization": "Bearer wrong", "x-api-key": "sk-beta"},
    ],
)
def test_both_header_styles(headers):
    checker = KeyChecker(load_api_keys(None, env={"JAXMOE_API_KEYS": "sk-alpha,sk-beta"}))
    assert checker.enabled
    assert checker.tenant(headers) == tenant_id("sk-beta")


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer sk-gamma"},
        {"Authorization": "Bearer "},
        {"Authorization": "Basic sk-alpha"},
        {"Authorization": "sk-alpha"},
        {"x-api-key": ""},
        {"x-api-key": "sk-alph"},
        {"x-api-key": "sk-alpha-and-more"},
        {"content-type": "application/json"},
    ],
)
def test_wrong_or_missing_key(headers):
    assert KeyChecker(["sk-alpha", "sk-beta"]).tenant(headers) is None


def test_auth_off_is_anonymous():
    checker = KeyChecker(None)
    assert not checker.enabled
    assert checker.tenant({}) == ANONYMOUS == "anonymous"
    assert checker.tenant({"x-api-key": "anything"}) == "anonymous"


def test_empty_key_set_is_refused():
    with pytest.raises(ValueError, match="keys"):
        KeyChecker([])


@pytest.mark.parametrize("presented", ["sk-k0", "sk-k3", "sk-k6", "nope"])
def test_every_key_is_compared_in_constant_time(monkeypatch, presented):
    keys = [f"sk-k{i}" for i in range(7)]
    checker = KeyChecker(keys)
    calls, compare = [], hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    want = tenant_id(presented) if presented in keys else None
    assert checker.tenant({"Authorization": f"Bearer {presented}"}) == want
    # Every key compared, whichever matches (first, middle, last, none), on equal-length digests.
    assert calls == [(32, 32)] * len(keys)
    calls.clear()
    assert checker.tenant({"Authorization": f"Bearer {presented}", "x-api-key": presented}) == want
    assert len(calls) == 2 * len(keys)
