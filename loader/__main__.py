"""``python -m loader``: the ``regiontrace`` command line with every command (``demo``, ``trace``, ``check``,
``plan``), as the ``regiontrace`` console script."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
