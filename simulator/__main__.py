"""`sluice simulate` is `python -m simulator`."""

import sys

from simulator.cli import main

sys.exit(main())
