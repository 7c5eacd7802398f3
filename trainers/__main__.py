"""``python -m trainers``: the ``multimesh-train`` command (no arguments: the tiny default config)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
