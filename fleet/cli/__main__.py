"""``python -m fleet.cli``: the ``fleet`` command."""

import sys

from fleet.cli.root import main

sys.exit(main())
