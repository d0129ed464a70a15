"""``python -m souffle_tvm.cli``: the ``souffle-tvm`` command."""

import sys

from . import main

sys.exit(main())
