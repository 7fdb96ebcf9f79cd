"""``python -m annot.cli``: the same as the ``annot`` command."""

import sys

from annot.cli.main import main

sys.exit(main())
