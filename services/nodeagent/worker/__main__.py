"""``python -m services.nodeagent.worker``: see :mod:`services.nodeagent.worker.cli`."""

import sys

from services.nodeagent.worker.cli import main

sys.exit(main())
