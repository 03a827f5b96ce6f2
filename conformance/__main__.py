"""``python -m conformance`` is the ``fsdp-conformance`` command."""

import sys

from conformance.cli import main

sys.exit(main())
