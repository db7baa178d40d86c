"""``python -m kvjax JOB [ARGS ...]``: the ``kvjax`` command (:mod:`kvjax.cli`) without the console script."""

import sys

from kvjax.cli import main

if __name__ == "__main__":
    sys.exit(main())
