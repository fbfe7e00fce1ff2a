"""``python -m fastinfer ...``: the command line (see :mod:`fastinfer.cli`)."""

import sys

from .cli import main

sys.exit(main())
