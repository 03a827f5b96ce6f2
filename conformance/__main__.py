"""``python -m conformance`` is the ``fsdp-conformance`` command."""

import sys

from conformance.runner.cli import main

sys.exit(main())
