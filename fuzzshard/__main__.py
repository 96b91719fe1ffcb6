"""python -m fuzzshard: the command line (fuzzshard/cli/)."""
import sys

from .cli import main

sys.exit(main())
