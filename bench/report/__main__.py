"""``python -m bench.report``: see the package docstring."""

import sys

from bench.report import main

sys.exit(main())
