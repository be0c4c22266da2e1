"""The credential a call presents: its one `authorization` header.

Every check that reads the header (the bearer-token interceptor, the tenants
file's, the rate limiter's per-caller key) reads it through `authorization`,
so they all see the same value. gRPC metadata may repeat a key; a call that
presents `authorization` more than once is refused as UNAUTHENTICATED by the
interceptors (RepeatedAuthorization), so a valid token sent last cannot pass
the check while a different value sent first picks the caller's rate bucket.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class RepeatedAuthorization(ValueError):
    """The call's metadata holds more than one `authorization` header."""

    def __init__(self, count: int) -> None:
        super().__init__(f"{count} authorization headers; a call presents one")
        self.count = count


def authorization(metadata: Iterable[tuple[str, Any]] | None) -> str | bytes | None:
    """The call's `authorization` value (None without one); RepeatedAuthorization when there are several."""
    values = [value for key, value in metadata or () if key == "authorization"]
    if len(values) > 1:
        raise RepeatedAuthorization(len(values))
    return values[0] if values else None
