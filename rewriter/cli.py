"""``annot rewrite PATH...``: the command line of the rewriter.

Exit codes: 0 done or nothing to do; 1 ``--check``/``--diff`` found changes, or
``--check`` found a marked / ``--blocks`` class called where it cannot be wrapped;
2 usage error, or any file failed (it is reported as ``path:line:col: reason`` and never
touched; the other files are still processed). Messages go to stderr, diffs to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

__all__ = ["main"]

_DEEPSPEED_SNIPPET = """\
DeepSpeed ignores the "activation_checkpointing" section of its config until this runs
once, after deepspeed.initialize(...) and before the first forward:

    import deepspeed
    deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)

checkpoint calls per forward (for "number_checkpoints"):
{calls}"""


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line naming the problem and where help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser(prog: str) -> argparse.ArgumentParser:
    p = _Parser(
        prog=prog,
        description="Wrap the block calls in forward() in activation checkpointing, in place.",
        epilog="Exit codes: 0 done or nothing to do, 1 --check/--diff found changes, "
        "2 usage error or a file failed.",
    )
    p.add_argument(
        "paths", nargs="+", metavar="PATH", help="files, or directories (recursive *.py)"
    )
    p.add_argument("--diff", action="store_true", help="print a unified diff; write nothing")
    p.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if anything would change"
    )
    p.add_argument("--undo", action="store_true", help="remove exactly what annot rewrite inserted")
    p.add_argument(
        "--target",
        choices=("deepspeed", "torch"),
        default="deepspeed",
        help="deepspeed.checkpointing.checkpoint (default) or torch.utils.checkpoint",
    )
    p.add_argument(
        "--blocks",
        metavar="CLASS[,CLASS...]",
        help="wrap calls to these classes (default: marked classes, else the trunk)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="skip files matching GLOB (repeatable)",
    )
    p.add_argument(
        "--functional",
        action="store_true",
        help="also wrap calls in comprehensions and functools.reduce lambdas",
    )
    p.add_argument(
        "-j",
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="worker processes (default: all cores)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="only errors")
    p.add_argument("-v", "--verbose", action="store_true", help="every site, skip and warning")
    return p


@dataclass
class _Outcome:
    path: str
    status: str  # "changed" | "unchanged" | "failed"
    error: str | None = None
    wrapped: list[tuple[int, int, str, str, str | None, str | None]] = field(default_factory=list)
    skipped: list[tuple[int, int, str, str, str, bool]] = field(default_factory=list)
    chosen: list[str] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    diff: str = ""


@dataclass(frozen=True)
class _Job:
    path: str
    undo: bool
    target: str
    blocks: frozenset[str] | None
    functional: bool
    write: bool
    diff: bool


def _marks_of(path: str) -> list:
    """Pass 1 (in a worker): the class marks one file states; unreadable files say nothing."""
    import libcst as cst

    from annot.rewriter._files import decode
    from annot.rewriter.marks import file_marks

    try:
        text, _ = decode(Path(path).read_bytes())
        return file_marks(text)
    except (cst.ParserSyntaxError, OSError, UnicodeDecodeError, SyntaxError, LookupError,
            RecursionError, MemoryError):
        # Reported by pass 2, which reads and parses the file again.
        return []


def _die_with_parent() -> None:
    """In a worker: end when the parent ends, even if it was killed (Linux; elsewhere the
    pool notices the lost parent at its next task)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _process(job: _Job) -> _Outcome:
    """Pass 2 (in a worker): rewrite or undo one file."""
    import libcst as cst

    from annot.rewriter._files import decode, encode, write_atomic
    from annot.rewriter.codemod import rewrite_source, undo_source

    path = Path(job.path)
    try:
        text, encoding = decode(path.read_bytes())
        if job.undo:
            result = undo_source(text)
        else:
            result = rewrite_source(
                text, target=job.target, blocks=job.blocks, functional=job.functional
            )
    except (RecursionError, MemoryError) as e:  # nesting deeper than the parsers go
        return _Outcome(job.path, "failed", f"{job.path}:1:1: too deeply nested to parse ({e or type(e).__name__})")
    except cst.ParserSyntaxError as e:
        return _Outcome(
            job.path, "failed", f"{job.path}:{e.raw_line}:{e.raw_column + 1}: {e.message}"
        )
    except OSError as e:
        return _Outcome(job.path, "failed", f"{job.path}:1:1: cannot read this file "
                        f"({e.strerror or e}); make it readable for this user or leave it out with --exclude")
    except (UnicodeDecodeError, SyntaxError, LookupError) as e:
        return _Outcome(job.path, "failed", f"{job.path}:1:1: {e}")
    except Exception as e:  # a bug of ours must not stop the other files
        return _Outcome(
            job.path, "failed", f"{job.path}:1:1: internal error: {type(e).__name__}: {e}"
        )
    out = _Outcome(
        job.path,
        "changed" if result.changed else "unchanged",
        wrapped=[
            (s.line, s.column, s.function, s.block, s.warning, s.cache_flag_on)
            for s in result.wrapped
        ],
        skipped=[
            (s.line, s.column, s.function, s.block, s.reason, s.unprotected)
            for s in result.skipped
        ],
        chosen=list(result.chosen),
        calls=list(result.calls_per_forward),
    )
    if result.changed:
        if job.diff:
            out.diff = "".join(
                difflib.unified_diff(
                    text.splitlines(keepends=True),
                    result.code.splitlines(keepends=True),
                    fromfile=job.path,
                    tofile=job.path,
                )
            )
        if job.write:
            try:
                write_atomic(path, encode(result.code, encoding))
            except OSError as e:
                return _Outcome(job.path, "failed", f"{job.path}:1:1: cannot write: {e}")
    return out


class _WorkerDied(Exception):
    """A worker process ended mid-run (killed, out of memory, a crash in native code):
    ``done`` holds the results that came back before, in order."""

    def __init__(self, done: list, cause: BaseException) -> None:
        super().__init__(str(cause) or type(cause).__name__)
        self.done = done


def _run_all(func, items: Sequence, jobs: int, progress: bool) -> list:
    """``map(func, items)`` over ``jobs`` processes, in order, with an optional progress bar.

    Raises `_WorkerDied` when a worker ends without an answer (what came back is kept)."""
    if jobs <= 1 or len(items) <= 1:
        results = []
        for i, item in enumerate(items):
            results.append(func(item))
            if progress:
                _progress(i + 1, len(items))
        return results
    chunk = max(1, min(16, len(items) // (jobs * 4)))
    results = []
    try:
        with ProcessPoolExecutor(max_workers=jobs, initializer=_die_with_parent) as pool:
            for i, r in enumerate(pool.map(func, items, chunksize=chunk)):
                results.append(r)
                if progress:
                    _progress(i + 1, len(items))
    except BrokenProcessPool as e:
        raise _WorkerDied(results, e) from None
    return results


def _worker_died(prog: str, error: _WorkerDied, items: Sequence[str]) -> None:
    """One line, whichever file and whichever pass (issue #33: not a traceback)."""
    left = items[len(error.done):]
    first = f" (the first: {left[0]})" if left else ""
    print(f"{prog}: error: a worker process ended without an answer ({error}); {len(left)} "
          f"file(s) not processed{first}: run again with -j 1 to see which file ends it",
          file=sys.stderr)


def _progress(done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\r" + " " * (width + 24) + "\r")
    sys.stderr.flush()


def _selection(
    args: argparse.Namespace, files: list[Path], progress: bool
) -> tuple[frozenset[str] | None, str]:
    if args.blocks is not None:
        names = frozenset(n.strip() for n in args.blocks.split(",") if n.strip())
        return names, "--blocks " + ", ".join(sorted(names))
    from annot.rewriter.marks import checkpointed_classes

    marks = [
        m for ms in _run_all(_marks_of, [str(f) for f in files], args.jobs, progress) for m in ms
    ]
    if any(m.checkpoint is not None for m in marks):  # the run uses marks: only marked classes
        chosen = checkpointed_classes(marks)
        return chosen, "marked classes: " + (
            ", ".join(sorted(chosen)) or "none (all marks are off)"
        )
    return (
        None,
        "no marks and no --blocks: the trunk (ModuleList/Sequential stacks called in forward)",
    )


def _say(quiet: bool, *lines: str) -> None:
    if not quiet:
        for line in lines:
            print(line, file=sys.stderr)


def _report(args: argparse.Namespace, outcomes: Iterable[_Outcome], selection: str) -> int:
    outcomes = list(outcomes)
    dry = args.check or args.diff
    changed = [o for o in outcomes if o.status == "changed"]
    failed = [o for o in outcomes if o.status == "failed"]
    for o in failed:
        print(o.error, file=sys.stderr)
    if args.diff:
        for o in changed:
            sys.stdout.write(o.diff)
    verb = "would " if dry else ""
    if not args.undo:
        _say(args.quiet, f"blocks: {selection}")
    reasons: Counter[str] = Counter()
    unprotected_sites: list[str] = []
    warnings = 0
    for o in outcomes:
        if o.status == "changed":
            _say(args.quiet, f"{verb}{'undo' if args.undo else 'rewrite'} {o.path}")
        for c in o.chosen:
            if args.verbose:
                _say(args.quiet, f"  {o.path}: chose {c}")
        for line, col, func, block, warning, flag_on in o.wrapped:
            if args.verbose:
                _say(args.quiet, f"{o.path}:{line}:{col}: wrapped {block}(...) in {func}")
            if warning:
                warnings += 1
                if args.verbose:
                    _say(args.quiet, f"{o.path}:{line}:{col}: warning: {warning}")
            if flag_on and not args.undo:
                # Said without -v: with the default left on, the rewrite does nothing at all.
                _say(args.quiet, f"{o.path}:{line}:{col}: note: {block}(...) in {func} is "
                     f"checkpointed only while use_cache is off, and it is on by default "
                     f"({flag_on}): training must pass use_cache=False (annot's "
                     "prepare_for_training does), or the guard skips recompute and nothing "
                     "here is checkpointed")
        for line, col, func, block, reason, unprotected in o.skipped:
            reasons[reason] += 1
            # Never silent: a file that gets nothing wrapped says why, loop by loop.
            if args.verbose or (not o.wrapped and not args.undo):
                _say(args.quiet, f"{o.path}:{line}:{col}: skipped {block} in {func}: {reason}")
            if unprotected:
                unprotected_sites.append(f"{o.path}:{line}:{col}: {block} in {func}: {reason}")
    n_wrapped = sum(len(o.wrapped) for o in outcomes)
    unchanged = len(outcomes) - len(changed) - len(failed)
    summary = (
        f"{len(changed)} file(s) {verb}{'changed' if not dry else 'change'}, {unchanged} unchanged, "
        f"{len(failed)} failed"
    )
    if not args.undo:
        would = "would be " if dry else ""
        summary += f"; {n_wrapped} site(s) {would}wrapped, {sum(reasons.values())} skipped"
    _say(args.quiet, summary)
    for reason, count in reasons.most_common():
        _say(args.quiet, f"  {count} skipped: {reason}")
    if warnings:
        _say(args.quiet, f"  {warnings} wrapped call(s) pass cache state (-v for where)")
    if (
        args.blocks is not None
        and not args.undo
        and not any(
            o.wrapped or any(not s[3].startswith("loop over") or s[5] for s in o.skipped)
            for o in outcomes
        )
    ):
        # An empty selection is an error elsewhere in annot (docs/design.md, pitfall 8): say so.
        print(f"warning: --blocks {args.blocks}: no forward calls these classes", file=sys.stderr)
    if args.target == "deepspeed" and not args.undo and changed:
        calls = "\n".join(f"  {c}" for o in changed for c in o.calls)
        _say(args.quiet, "", _DEEPSPEED_SNIPPET.format(calls=calls))
    if failed:
        return 2
    if args.check and unprotected_sites and not args.undo:
        print("error: selected blocks called where they cannot be wrapped:", file=sys.stderr)
        for site in unprotected_sites:
            print(f"  {site}", file=sys.stderr)
        return 1
    if dry and changed:
        return 1
    return 0


def main(argv: list[str] | None = None, prog: str = "annot rewrite") -> int:
    """Parse ``annot rewrite`` arguments, run, and return the exit code."""
    parser = _parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return int(e.code or 0)
    if args.jobs < 1:
        print(f"{prog}: error: -j must be at least 1, got {args.jobs}", file=sys.stderr)
        return 2
    if args.quiet and args.verbose:
        args.verbose = False
    try:
        from annot.rewriter._files import find_python_files

        unreadable: list[str] = []
        files = find_python_files(args.paths, args.exclude, unreadable)
    except FileNotFoundError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    for message in unreadable:  # reported, and the exit status says so (below)
        print(f"{prog}: error: {message}", file=sys.stderr)
    args.jobs = min(args.jobs, max(1, len(files)))
    progress = sys.stderr.isatty() and len(files) > 20 and not args.quiet
    try:
        blocks, selection = (None, "") if args.undo else _selection(args, files, progress)
    except _WorkerDied as e:
        _worker_died(prog, e, [str(f) for f in files])
        return 2
    jobs = [
        _Job(
            str(f),
            args.undo,
            args.target,
            blocks,
            args.functional,
            write=not (args.check or args.diff),
            diff=args.diff,
        )
        for f in files
    ]
    try:
        outcomes = _run_all(_process, jobs, args.jobs, progress)
    except _WorkerDied as e:
        _worker_died(prog, e, [str(f) for f in files])
        _report(args, e.done, selection)  # what was done is still said
        return 2
    status = _report(args, outcomes, selection)
    return 2 if unreadable else status
