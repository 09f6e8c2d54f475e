"""``python -m gpusched.services.nodeagent.worker``: see
:mod:`gpusched.services.nodeagent.worker.cli`."""

import sys

from gpusched.services.nodeagent.worker.cli import main

sys.exit(main())
