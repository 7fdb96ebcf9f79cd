"""``python -m annot.verify``: see `annot.verify`."""

import sys

from annot.verify.command import main

sys.exit(main())
