"""The ``gpusched`` command's entry point.

``gpusched decode`` is run once per message by ``nats sub --translate``, so it starts
without the rest of the command line (typer, rich, the live commands): only the codec.
Every other command line, ``decode --help`` included, goes to the full CLI.
"""

from __future__ import annotations

import sys

from gpusched.services.cli.decode import decode_stdin


def main() -> None:
    if sys.argv[1:] == ["decode"]:
        decode_stdin()
        return
    from gpusched.services.cli.main import main as full_cli

    full_cli()


if __name__ == "__main__":
    main()
