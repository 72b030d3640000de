"""``python -m hvd_lm ...`` == ``hvd-lm ...`` (handy under launchers: ``horovodrun ... python -m
hvd_lm train``)."""
import sys

from hvd_lm.cli import main

sys.exit(main())
