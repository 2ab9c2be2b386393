"""`python -m cocodiff`: the same command as the `cocodiff` console script."""

import sys

from .cli import main

sys.exit(main())
