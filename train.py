#!/usr/bin/env python
"""``python train.py --help``: the command-line entry point of :mod:`kvjax.train.cli`."""

import sys

from kvjax.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
