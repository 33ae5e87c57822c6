"""python -m benchmarks.evaluation: see benchmarks/evaluation/README.md."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
