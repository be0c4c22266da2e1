"""Page tokens: opaque, authenticated cursors for QueryResidency and ListSessions.

A token is `base64url(body) "." base64url(mac)`: `body` is compact JSON
{"e": epoch, "s": scope, <cursor key>: value}, and `mac` is HMAC-SHA256 of the
body under a 32-byte random key minted with the codec. One codec lives as long
as one servicer, that is one epoch, so a token from before a restart fails
authentication. Verification order: size, shape, MAC (compared in constant
time), JSON, then the type and range of every field, so a token this server
did not issue never reaches a query, and one it did issue is still checked
(defence in depth). Every failure is INVALID_ARGUMENT with field
"page_token"; messages never quote the token.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
from typing import Any

from .errors import RpcError, invalid_argument

#: Longest token accepted, in characters, unless the cursor's own bound allows a longer one
#: (`PageTokens.max_token_chars`: a string cursor of max_len UTF-8 bytes, JSON-escaped and
#: base64-encoded, can take up to about 8 characters a byte).
MAX_TOKEN_CHARS = 2048
#: Characters JSON (ASCII-escaped, as `issue` writes it) spends on one byte of a string at most:
#: a control character becomes a six-character escape.
_JSON_CHARS_PER_BYTE = 6
_MAC_CHARS = 43  # unpadded base64 of a 32-byte HMAC-SHA256
FIELD = "page_token"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _bad(message: str) -> RpcError:
    return invalid_argument(message, FIELD)


class PageTokens:
    """Issues and verifies the page tokens of one epoch."""

    def __init__(self, epoch: str, key: bytes | None = None) -> None:
        self.epoch = epoch
        self._key = key if key is not None else secrets.token_bytes(32)

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest()

    def issue(self, scope: str, key: str, value: int | str) -> str:
        """A token for the page after cursor `key`=`value` of query `scope`."""
        body = json.dumps({"e": self.epoch, "s": scope, key: value}, separators=(",", ":")).encode()
        return f"{_b64(body)}.{_b64(self._mac(body))}"

    def max_token_chars(self, scope: str, key: str, max_len: int) -> int:
        """The longest token `issue(scope, key, value)` makes for a string cursor of at most
        `max_len` UTF-8 bytes (every byte escaped at worst), and never under MAX_TOKEN_CHARS."""
        skeleton = len(json.dumps({"e": self.epoch, "s": scope, key: ""}, separators=(",", ":")).encode())
        body = skeleton + _JSON_CHARS_PER_BYTE * max_len
        return max(MAX_TOKEN_CHARS, -(-4 * body // 3) + 1 + _MAC_CHARS)

    def verify(self, token: str, scope: str, key: str, kind: type, max_len: int) -> Any:
        """The cursor value of a token issued by `issue(scope, key, ...)`.

        `kind` is int (a non-negative offset) or str (an id of at most
        `max_len` UTF-8 bytes). Raises RpcError(INVALID_ARGUMENT) otherwise.
        A token longer than any `issue` makes for such a cursor is refused before it is
        decoded (max_token_chars).
        """
        limit = MAX_TOKEN_CHARS if kind is int else self.max_token_chars(scope, key, max_len)
        if len(token) > limit:
            raise _bad(f"page_token is longer than {limit} characters")
        body_b64, dot, mac_b64 = token.partition(".")
        try:
            if not dot:
                raise ValueError("no MAC")
            body, mac = _unb64(body_b64), _unb64(mac_b64)
        except (ValueError, binascii.Error):
            raise _bad("page_token is not a token this server issued") from None
        if not hmac.compare_digest(mac, self._mac(body)):
            raise _bad("page_token was not issued in this epoch (the engine restarted) or was altered")
        try:
            payload = json.loads(body)
        except ValueError:
            raise _bad("page_token is not a token this server issued") from None
        if not isinstance(payload, dict) or payload.get("e") != self.epoch:
            raise _bad("page_token is not a token this server issued")
        if payload.get("s") != scope:
            raise _bad("page_token belongs to a different query")
        return _check_cursor(payload.get(key), key, kind, max_len)


def _check_cursor(value: Any, key: str, kind: type, max_len: int) -> Any:
    if kind is int:
        # bool is an int subclass: refuse it explicitly.
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise _bad(f"page_token cursor {key!r} must be a non-negative integer")
        return value
    if not isinstance(value, str) or not value or len(value.encode("utf-8", "surrogatepass")) > max_len:
        raise _bad(f"page_token cursor {key!r} must be a non-empty string of at most {max_len} bytes")
    return value
