"""``python -m regiontrace``: the algebra's commands, ``trace`` and ``check``.

The ``regiontrace`` console script (``loader.cli``, also ``python -m loader``) has these and the loader's
``plan`` and ``demo``.
"""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
