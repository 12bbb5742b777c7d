"""`python -m SneppX_ALG.demo` (what `make demo` runs): the orchestrator, or one of its child processes."""

import sys

from SneppX_ALG.demo.scenario import main

sys.exit(main())
