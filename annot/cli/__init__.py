"""The ``annot`` command: ``annot plan`` and ``annot rewrite``.

Only the standard library is imported here, so ``annot rewrite`` starts without torch.
"""

from annot.cli.main import main

__all__ = ["main"]
