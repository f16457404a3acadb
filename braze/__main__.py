"""`python -m braze ...` is the `braze` command."""

import sys

from .cli import main

sys.exit(main())
