"""``python -m dmuon_compile.plan``: see :mod:`dmuon_compile.plan.cli`."""

import sys

from dmuon_compile.plan.cli import main

sys.exit(main())
