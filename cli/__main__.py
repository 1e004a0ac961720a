"""``python -m splitgrad.cli``: the ``splitgrad`` command without its console script."""

import sys

from . import main

sys.exit(main())
