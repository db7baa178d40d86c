#!/usr/bin/env python
"""``python eval.py --help``: the command-line entry point of :mod:`kvjax.evaluation.cli`."""

import sys

from kvjax.evaluation.cli import main

if __name__ == "__main__":
    sys.exit(main())
