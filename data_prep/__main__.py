"""``python -m data_prep prepare|verify ...`` (parser in :mod:`data_prep.cli`)."""

import sys

from data_prep.cli import main

if __name__ == "__main__":
    sys.exit(main())
