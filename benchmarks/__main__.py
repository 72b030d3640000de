"""``python -m benchmarks NAME [flags]`` (the table: :data:`benchmarks.BENCHMARKS`)."""

import sys

from benchmarks import main

sys.exit(main())
