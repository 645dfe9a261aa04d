"""``python -m jaxcomm.bench``: see :mod:`jaxcomm.bench.cli`."""

import sys

from .cli import main

sys.exit(main())
