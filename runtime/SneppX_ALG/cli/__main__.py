"""`python -m SneppX_ALG.cli ...`: the same as the `sneppx` console script."""

import sys

from SneppX_ALG.cli import main

sys.exit(main())
