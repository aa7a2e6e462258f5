"""`python -m posttrain.cli ...`: the `posttrain` command (`posttrain.cli.main`)."""

import sys

from posttrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
