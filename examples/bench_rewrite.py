"""Benchmark ``annot rewrite`` on every transformers ``modeling_*.py`` installed.

Compares, in one run and over the same files, the whole command (``--check``, so nothing
is written: discovery, marks pass, analysis, rewrite, codegen, diagnostics) with a bare
libcst parse + codegen of each file, for 1 and 2 worker processes. Prints a table:
wall seconds, files per second, and the ratio rewrite / bare, by wall time and by CPU
time (this process and its workers; CPU time does not move when other programs share the
machine, wall time does). Goal: ratio at most 1.3 on one worker.

    python -m examples.bench_rewrite [--jobs 1 2] [--verify] [--limit N]   # from the repo root

``--verify`` also checks every file: no crash, the output parses, a second run changes
nothing, ``--undo`` gives the bytes back, files without a site are unchanged, and every
wrapped call that passes KV-cache state has the cache tests in its guard (so a
recomputation never runs with a live cache); it prints the counts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import libcst as cst

from annot.rewriter import rewrite_source, undo_source
from annot.rewriter.cli import main as rewrite_main
from annot.rewriter.containers import child_nodes
from annot.rewriter.sites import _REPLAYED_STATE, is_annot_guard

_OFF = ("None", "False")


def corpus() -> list[Path]:
    import transformers

    return sorted(Path(transformers.__file__).parent.glob("models/*/modeling_*.py"))


def bare(path: Path) -> int:
    """What any libcst tool pays: read, parse, generate the code again."""
    return len(cst.parse_module(path.read_text(encoding="utf-8")).code)


def _cpu() -> float:
    """CPU seconds of this process and of its finished worker processes."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def timed_bare(files: list[Path], jobs: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), _cpu()
    if jobs == 1:
        for f in files:
            bare(f)
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(bare, files, chunksize=max(1, min(16, len(files) // (jobs * 4)))))
    return time.perf_counter() - wall, _cpu() - cpu


def timed_rewrite(files: list[Path], jobs: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), _cpu()
    with contextlib.redirect_stderr(io.StringIO()):
        code = rewrite_main([str(f) for f in files] + ["--check", "-q", "-j", str(jobs)])
    assert code in (0, 1), f"annot rewrite exited {code}"
    return time.perf_counter() - wall, _cpu() - cpu


def verify(path: Path) -> Counter[str]:
    counts: Counter[str] = Counter(files=1)
    source = path.read_text(encoding="utf-8")
    try:
        result = rewrite_source(source)
    except Exception:
        counts["crashed"] += 1
        return counts
    counts["sites wrapped"] += len(result.wrapped)
    counts["sites skipped"] += len(result.skipped)
    if not result.changed:
        counts["unchanged"] += 1
        counts["unchanged but bytes differ"] += result.code != source
        return counts
    counts["changed"] += 1
    try:
        cst.parse_module(result.code)
        compile(result.code, str(path), "exec")
    except Exception:
        counts["output does not parse"] += 1
    passing, unguarded = kv_guards(cst.parse_module(result.code))
    counts["wrapped calls passing a KV cache"] += passing
    counts["KV-cache calls with no cache test"] += unguarded
    counts["second run changes"] += rewrite_source(result.code).code != result.code
    counts["undo differs"] += undo_source(result.code).code != source
    return counts


def _nodes(node: cst.CSTNode):
    yield node
    for child in child_nodes(node):
        yield from _nodes(child)


def kv_guards(module: cst.Module) -> tuple[int, int]:
    """(wrapped calls passing KV-cache state, those whose guard does not test it).

    A cache argument is an argument named like one (`past_key_values=`, `use_cache=`, ...)
    or whose value mentions such a name; literal None/False pass no cache. The guard must
    test each such value (`not use_cache`, `past_key_values is None`).
    """
    passing = unguarded = 0
    for guard in (n for n in _nodes(module) if is_annot_guard(n)):
        test = module.code_for_node(guard.test)
        original = guard.orelse.body.body[0]
        values = []
        for call in (n for n in _nodes(original) if isinstance(n, cst.Call)):
            for arg in call.args:
                key = arg.keyword.value if arg.keyword is not None else None
                names = {n.value for n in _nodes(arg.value) if isinstance(n, cst.Name)}
                if key in _REPLAYED_STATE or names & _REPLAYED_STATE:
                    if not (isinstance(arg.value, cst.Name) and arg.value.value in _OFF):
                        values.append(module.code_for_node(arg.value))
        if values:
            passing += 1
            unguarded += any(v not in test for v in values)
    return passing, unguarded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--limit", type=int, help="only the first N files (a quick look)")
    args = parser.parse_args()
    files = corpus()[:args.limit]
    size = sum(f.stat().st_size for f in files) / 1e6
    print(f"corpus: {len(files)} files, {size:.1f} MB, {os.cpu_count()} CPUs")
    print(f"{'jobs':>4} {'bare s':>8} {'rewrite s':>10} {'bare f/s':>9} {'rewrite f/s':>12} "
          f"{'ratio wall':>11} {'ratio cpu':>10}")
    for jobs in args.jobs:
        bare_wall, bare_cpu = timed_bare(files, jobs)
        rewrite_wall, rewrite_cpu = timed_rewrite(files, jobs)
        print(f"{jobs:>4} {bare_wall:>8.2f} {rewrite_wall:>10.2f} {len(files) / bare_wall:>9.1f} "
              f"{len(files) / rewrite_wall:>12.1f} {rewrite_wall / bare_wall:>11.2f} "
              f"{rewrite_cpu / bare_cpu:>10.2f}")
    if args.verify:
        total: Counter[str] = Counter()
        with ProcessPoolExecutor() as pool:
            for counts in pool.map(verify, files, chunksize=8):
                total.update(counts)
        for key in (
            "files",
            "changed",
            "unchanged",
            "sites wrapped",
            "sites skipped",
            "crashed",
            "output does not parse",
            "second run changes",
            "undo differs",
            "unchanged but bytes differ",
            "wrapped calls passing a KV cache",
            "KV-cache calls with no cache test",
        ):
            print(f"{key:>28}: {total[key]}")


if __name__ == "__main__":
    main()
