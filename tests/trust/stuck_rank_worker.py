"""Run by test_stuck_rank.py under torchrun: join through `annot.init_distributed` with
a short timeout, then rank 1 stops itself (SIGSTOP, as a debugger or a frozen host
would) while rank 0 waits for it in an all-reduce.

    torchrun ... stuck_rank_worker.py TIMEOUT_S"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import annot

if __name__ == "__main__":
    annot.init_distributed(timeout=float(sys.argv[1]))
    dist.all_reduce(torch.ones(1))  # both ranks are up
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    finally:
        print(f"rank {dist.get_rank()} waited {time.monotonic() - started:.1f} s", flush=True)
