"""The version of annot (one place; the package root and the command line read it)."""

__version__ = "0.2.0"
