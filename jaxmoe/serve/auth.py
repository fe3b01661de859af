"""API keys: where they come from, and which tenant a request's headers identify.

Keys come from ``--api-keys FILE`` (one a line; blank lines and lines starting with ``#`` are
skipped; whitespace around a key is stripped) and from ``JAXMOE_API_KEYS`` (comma-separated); both
sources add up. With neither, authentication is off and every request is tenant ``"anonymous"``.

A request presents a key as ``Authorization: Bearer KEY`` (the OpenAI SDK) or ``x-api-key: KEY``
(the Anthropic SDK). :class:`KeyChecker` compares it against every configured key in constant time,
without an early exit and without a lookup keyed by the presented string, so response timing tells
nothing about which keys exist or how much of one matched. The tenant it returns (``key-`` and 16 hex
digits of the key's SHA-256) is stable across restarts, names the key in logs and metrics without
revealing it, and keeps each key's prefix cache apart from every other key's.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping

ENV_VAR = "JAXMOE_API_KEYS"
ANONYMOUS = "anonymous"


def tenant_id(key: str) -> str:
    """The tenant a key identifies: ``key-`` and the first 16 hex digits of its SHA-256."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _check_key(key: str, where: str) -> str:
    # A header value is one line of visible ASCII; a key that cannot travel in one could never match.
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise ValueError(f"{where}: an API key must be visible ASCII characters without spaces")
    return key


def _keys_from_file(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"--api-keys {path!r}: cannot read the file ({e.strerror or e})") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"--api-keys {path!r}: not UTF-8 text") from e
    keys = []
    for n, line in enumerate(lines, start=1):
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(_check_key(line, f"--api-keys {path!r} line {n}"))
    if not keys:
        raise ValueError(f"--api-keys {path!r}: the file holds no key (one a line, '#' starts a comment)")
    return keys


def load_api_keys(path: str | None, env: Mapping[str, str] = os.environ) -> dict[str, str] | None:
    """The configured API keys, each mapped to its tenant, or None when authentication is off.

    Args:
        path: ``--api-keys FILE``, or None.
        env: the environment; ``JAXMOE_API_KEYS`` holds comma-separated keys (unset or blank: none).

    Returns:
        ``{key: tenant_id(key)}`` over the file's and the environment's keys; None with neither.

    Raises:
        ValueError: the file is missing, unreadable or holds no key; a key holds spaces or
            non-ASCII characters; ``JAXMOE_API_KEYS`` is set to commas only.
    """
    keys: list[str] = []
    if path is not None:
        keys += _keys_from_file(path)
    value = env.get(ENV_VAR, "")
    if value.strip():
        from_env = [k.strip() for k in value.split(",") if k.strip()]
        if not from_env:
            raise ValueError(f"{ENV_VAR}: holds no key (comma-separated keys expected)")
        keys += [_check_key(k, ENV_VAR) for k in from_env]
    if path is None and not keys:
        return None
    return {k: tenant_id(k) for k in keys}


def _presented_keys(headers: Mapping[str, str]) -> list[str]:
    """The keys a request presents: the Bearer token of ``Authorization`` and ``x-api-key``."""
    bearer, api_key = [], []
    for name, value in headers.items():
        name = name.lower()
        if name == "authorization":
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                bearer.append(token.strip())
        elif name == "x-api-key" and value.strip():
            api_key.append(value.strip())
    return bearer + api_key


class KeyChecker:
    """Maps a request's headers to its tenant.

    Args:
        keys: ``{key: tenant}`` (what :func:`load_api_keys` returns), an iterable of keys (tenants
            from :func:`tenant_id`), or None: authentication off, every request is ``"anonymous"``.
    """

    def __init__(self, keys: Mapping[str, str] | Iterable[str] | None):
        if keys is None:
            self._keys = None
            return
        if not isinstance(keys, Mapping):
            keys = {k: tenant_id(k) for k in keys}
        if not keys:
            raise ValueError("keys: at least one API key, or None to turn authentication off")
        # Digests have one length, so compare_digest's time depends on neither key's length.
        self._keys = [(hashlib.sha256(k.encode()).digest(), t) for k, t in keys.items()]

    @property
    def enabled(self) -> bool:
        """Whether requests must present a key."""
        return self._keys is not None

    def tenant(self, headers: Mapping[str, str]) -> str | None:
        """The tenant of the key the headers present; None when no configured key is presented.

        Args:
            headers: the request's headers (names in any case).

        Returns:
            The tenant of the first presented key that matches (``Authorization`` before
            ``x-api-key`` where both are sent), ``"anonymous"`` with authentication off, or None.
        """
        if self._keys is None:
            return ANONYMOUS
        found = None
        for presented in _presented_keys(headers):
            digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
            for key_digest, tenant in self._keys:
                # Every key is compared, whichever matched: no early exit.
                if hmac.compare_digest(digest, key_digest) and found is None:
                    found = tenant
        return found


__all__ = ["ANONYMOUS", "ENV_VAR", "KeyChecker", "load_api_keys", "tenant_id"]
