"""``python -m graddbg``: the command line."""
import sys

from graddbg.cli import main

sys.exit(main())
