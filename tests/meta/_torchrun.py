"""Launch a worker script on N CPU ranks with torchrun, with a timeout so a hang fails."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: Path, ranks: int, *args: str, timeout: int = 180) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
           f"--master_port={free_port()}", str(script), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        # The children's own tracebacks come first; torchrun's summary last.
        lines = [line for line in result.stderr.splitlines() if "Warning" not in line]
        raise AssertionError("\n".join(lines[:60] + ["..."] + lines[-15:]))
