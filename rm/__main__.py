"""`python -m rm train --config run.yaml`: the `reward` command."""

import sys

from rm.cli import main

sys.exit(main())
