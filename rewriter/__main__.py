"""``python -m rewriter PATH...``: the same as ``annot rewrite PATH...``."""

import sys

from annot.rewriter.cli import main

sys.exit(main(prog="python -m rewriter"))
