"""`python -m remat` runs the command line, like the `remat` script."""

import sys

from remat.cli.main import main

sys.exit(main())
