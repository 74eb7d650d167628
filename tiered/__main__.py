"""``python -m tiered``: the command line (tiered.cli)."""

import sys

from .cli import main

sys.exit(main())
