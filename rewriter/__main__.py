"""``python -m annot.rewriter PATH...``: the same as ``annot rewrite PATH...``."""

import sys

from annot.rewriter.cli import main

sys.exit(main(prog="python -m annot.rewriter"))
