"""``python -m collectives.testing MODULE:FUNCTION ...``: see :mod:`collectives.testing.runner`."""

import sys

from .runner import main

sys.exit(main())
