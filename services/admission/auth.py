"""Bearer tokens to tenants."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from gpusched.services.admission.config import OPEN_TENANT
from gpusched.services.admission.problems import ProblemError

REALM = "gpusched"
#: accepted Authorization headers remembered at most (spellings of each token: "Bearer"
#: in any case, spaces around it)
MAX_ACCEPTED_HEADERS = 1024


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class Authenticator:
    """Maps ``Authorization: Bearer <token>`` to a tenant. With no tokens configured the
    API is open and every request belongs to ``OPEN_TENANT``.

    Tokens are looked up by their SHA-256, so how long a lookup takes says nothing about
    how close a guess came to a real token."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._tenants = {_digest(token): tenant for token, tenant in tokens.items()}
        #: Authorization headers already accepted -> tenant, so a client's every request
        #: is not hashed again. Only accepted headers enter, so it holds a few per token;
        #: its lookup compares a guess with an entry only where their (randomised) string
        #: hashes are equal, so it says no more about a guess than the digest lookup
        self._accepted: dict[str, str] = {}

    @property
    def open(self) -> bool:
        return not self._tenants

    def tenant(self, authorization: str | None) -> str:
        if self.open:
            return OPEN_TENANT
        if authorization is not None:
            known = self._accepted.get(authorization)
            if known is not None:
                return known
        if not authorization:
            raise ProblemError(
                401,
                "unauthorized",
                "send 'Authorization: Bearer <token>'",
                headers={"WWW-Authenticate": f'Bearer realm="{REALM}"'},
            )
        scheme, _, token = authorization.strip().partition(" ")
        tenant = self._tenants.get(_digest(token.strip())) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise ProblemError(
                401,
                "unauthorized",
                "the bearer token is not valid",
                headers={
                    "WWW-Authenticate": f'Bearer realm="{REALM}", error="invalid_token"'
                },
            )
        if len(self._accepted) >= MAX_ACCEPTED_HEADERS:
            self._accepted.clear()
        self._accepted[authorization] = tenant
        return tenant
