"""Bearer tokens to tenants."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from gpusched.services.admission.config import OPEN_TENANT
from gpusched.services.admission.problems import ProblemError

REALM = "gpusched"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class Authenticator:
    """Maps ``Authorization: Bearer <token>`` to a tenant. With no tokens configured the
    API is open and every request belongs to ``OPEN_TENANT``.

    Tokens are looked up by their SHA-256, so how long a lookup takes says nothing about
    how close a guess came to a real token."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._tenants = {_digest(token): tenant for token, tenant in tokens.items()}

    @property
    def open(self) -> bool:
        return not self._tenants

    def tenant(self, authorization: str | None) -> str:
        if self.open:
            return OPEN_TENANT
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
        return tenant
