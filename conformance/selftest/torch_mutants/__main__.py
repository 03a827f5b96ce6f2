"""``python -m conformance.selftest.torch_mutants``: see :mod:`conformance.selftest.torch_mutants.campaign_cli`."""

import sys

from conformance.selftest.torch_mutants.campaign_cli import main

sys.exit(main())
