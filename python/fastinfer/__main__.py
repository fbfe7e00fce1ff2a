"""``python -m fastinfer ...``: the command line (see :mod:`fastinfer.entrypoints.cli`)."""

import sys

from .entrypoints.cli import main

sys.exit(main())
