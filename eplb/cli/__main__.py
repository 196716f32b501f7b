"""`python -m eplb.cli`: the same as the `eplb` command."""

import sys

from eplb.cli import main

sys.exit(main())
