"""``python -m annot.verify``: one command that checks annot on a device and writes a report.

    python -m annot.verify --device cuda --out verify.json   # on one GPU, at most 20 min
    python -m annot.verify --device cpu --out verify.json    # the rows a CPU can run

Each row is a function (in `annot.verify.training`, `annot.verify.speed` and
`annot.verify.memory`; their order is `annot.verify.command.ROWS`, DeepSpeed's last)
that runs one check through annot's public API and torch's own trackers
(``torch.cuda.max_memory_allocated``, dynamo's graph-break count, wall clocks read with
the device synchronized) and returns a dict: ``name``, ``status`` (``pass``, ``fail``,
``skipped`` or ``error``), its figures, and ``reason`` (what was compared, against what
bound; why it was skipped; the error). Rows that need a GPU are skipped on the CPU with
``no CUDA device (found: ...)``; rows that need an optional package (transformers,
DeepSpeed) are skipped naming it.

Exit status: 0 when no row failed or raised; 1 when one did; 2 for a bad command line;
3 when ``--device cuda`` was asked for and there is no CUDA device (every row is then
reported skipped and the file is still written: nothing was verified, so a GPU job
that lost its GPU does not pass).
"""

from __future__ import annotations

from annot.verify.command import main, run_rows

__all__ = ["main", "run_rows"]
