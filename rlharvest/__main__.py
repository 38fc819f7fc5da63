"""``python -m rlharvest``: same as the ``rlharvest`` console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
