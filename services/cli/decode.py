"""``gpusched decode``: a NATS message's MessagePack payload as JSON.

``nats sub --translate`` runs it once per message, so it loads the codec alone; the
entry point runs it without the rest of the command line."""

from __future__ import annotations

import sys


def decode_stdin() -> None:
    """Read MessagePack from stdin, print JSON."""
    from gpusched.libs.common import codec

    print(codec.to_json_text(sys.stdin.buffer.read()))
