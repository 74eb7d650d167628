"""``python -m tiered``: the command line (tiered.commands.cli)."""

import sys

from .commands.cli import main

sys.exit(main())
