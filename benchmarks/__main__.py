"""`python -m benchmarks <name> ...`: what `sluice bench <name> ...` runs."""

import sys

from benchmarks.cli import main

sys.exit(main())
