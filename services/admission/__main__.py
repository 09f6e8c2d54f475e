"""``python -m gpusched.services.admission``: the admission service, configured from the
environment (see ``AdmissionConfig.from_env``)."""

from __future__ import annotations

import asyncio
import sys

from gpusched.libs.common.logging import configure_logging
from gpusched.services.admission.config import AdmissionConfig
from gpusched.services.admission.service import serve


def main() -> None:
    configure_logging()
    try:
        config = AdmissionConfig.from_env()
    except ValueError as exc:
        print(f"gpusched admission: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
