"""``python -m sparse_mla.bench [options]``: the same as ``sparse-mla bench``."""

import sys

from . import main

sys.exit(main(sys.argv[1:]))
