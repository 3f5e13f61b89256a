"""``python -m kvslim ...``: the ``kvslim`` command (for an environment whose scripts folder is not on PATH)."""

import sys

from kvslim.cli.main import main

sys.exit(main())
