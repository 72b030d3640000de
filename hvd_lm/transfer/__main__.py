"""``python -m hvd_lm.transfer CHECKPOINT ...`` == ``hvd-lm transfer CHECKPOINT ...`` (launchable
under ``horovodrun``/``mpirun``)."""
import sys

from hvd_lm.transfer.run import TRANSFER

sys.exit(TRANSFER.main(None, "python -m hvd_lm.transfer"))
