"""Files: finding them, reading them in their own encoding, writing them atomically."""

from __future__ import annotations

import fnmatch
import io
import os
import tempfile
import tokenize
from collections.abc import Iterable
from pathlib import Path

__all__ = ["decode", "encode", "find_python_files", "write_atomic"]


def _excluded(path: Path, root: Path, patterns: Iterable[str]) -> bool:
    try:
        rel = path.relative_to(root).as_posix()
    except ValueError:
        rel = path.as_posix()
    return any(
        fnmatch.fnmatch(rel, p)
        or fnmatch.fnmatch(path.name, p)
        or fnmatch.fnmatch(path.as_posix(), p)
        for p in patterns
    )


def find_python_files(paths: Iterable[str], exclude: Iterable[str] = ()) -> list[Path]:
    """Files named, plus ``*.py`` under directories named (sorted, deduplicated).

    Raises FileNotFoundError for a path that does not exist.
    """
    patterns = list(exclude)
    found: dict[Path, None] = {}
    for name in paths:
        path = Path(name)
        if path.is_dir():
            for file in sorted(path.rglob("*.py")):
                if file.is_file() and not _excluded(file, path, patterns):
                    found[file] = None
        elif path.is_file():
            if not _excluded(path, path.parent, patterns):
                found[path] = None
        else:
            raise FileNotFoundError(f"{name}: no such file or directory")
    return list(found)


def decode(data: bytes) -> tuple[str, str]:
    """(text, encoding) honouring a BOM or ``# -*- coding: ... -*-`` cookie (PEP 263).

    A UTF-8 BOM stays in the text as U+FEFF so that `encode` puts it back.
    """
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    if encoding == "utf-8-sig":
        return data.decode("utf-8"), "utf-8"
    # newline="" semantics: bytes.decode never translates line endings.
    return data.decode(encoding), encoding


def encode(text: str, encoding: str) -> bytes:
    return text.encode(encoding)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` via a temporary file and rename, keeping its mode."""
    mode = path.stat().st_mode
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".annot-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
