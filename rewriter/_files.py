"""Files: finding them, reading them in their own encoding, writing them atomically."""

from __future__ import annotations

import fnmatch
import io
import os
import stat
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


def find_python_files(paths: Iterable[str], exclude: Iterable[str] = (),
                      unreadable: list[str] | None = None) -> list[Path]:
    """Files named, plus ``*.py`` under directories named (sorted; a file reached twice,
    e.g. through a symbolic link, once).

    A folder that cannot be listed or looked into is appended to ``unreadable`` once
    (one line naming it and the fix) instead of being skipped in silence or ending the
    run with a traceback; its files are left out. Raises FileNotFoundError for a path
    that does not exist.
    """
    patterns = list(exclude)
    found: dict[Path, Path] = {}  # the real file -> the first name it was found under
    refused: dict[Path, str | None] = {}  # folder -> why it cannot be read

    def note(folder: object, reason: str | None) -> None:
        refused.setdefault(Path(str(folder)), reason)

    def kind(path: Path) -> str | None:
        """"dir", "file" or None (missing); a refusal is noted against the folder holding it."""
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            return None
        except OSError as error:
            # stat needs search permission on the folders above, never on the file itself.
            note(path.parent if path.parent != path else path, error.strerror)
            return "refused"
        return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else None

    for name in paths:
        path = Path(name)
        what = kind(path)
        if what == "dir":
            files: list[Path] = []
            for folder, dirs, names in os.walk(path, onerror=lambda e: note(e.filename, e.strerror)):
                dirs.sort()
                files += [Path(folder, n) for n in names if n.endswith(".py")]
            for file in sorted(files):
                if kind(file) == "file" and not _excluded(file, path, patterns):
                    found.setdefault(file.resolve(), file)
        elif what == "file":
            if not _excluded(path, path.parent, patterns):
                found.setdefault(path.resolve(), path)
        elif what is None:
            raise FileNotFoundError(f"{name}: no such file or directory")
    if unreadable is not None:
        # One line per refused folder, however many of its files or sub-folders failed,
        # and none for a folder inside another refused one (issue #33).
        for closed, reason in sorted(refused.items()):
            if not any(closed != other and closed.is_relative_to(other) for other in refused):
                unreadable.append(f"{closed}: cannot read this folder ({reason}); make it "
                                  "readable for this user (chmod u+rx) or leave it out with --exclude")
    return list(found.values())


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
    """Replace ``path`` with ``data`` via a temporary file and rename, keeping its mode.

    A symbolic link is written through: its target gets the new contents and the link
    stays a link. A file without write permission (for this user, or marked read-only
    with no write bit at all, which root could otherwise replace) is refused with
    ``PermissionError``, as black refuses it: the rename would get past the permission.
    """
    target = path.resolve()
    mode = target.stat().st_mode
    if not os.access(target, os.W_OK) or not mode & 0o222:
        raise PermissionError(f"{path} is read-only; not rewritten (make it writable to allow)")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".annot-tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode & 0o7777)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
