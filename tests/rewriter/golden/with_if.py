import contextlib

import torch
from torch import nn

from annot import checkpoint_block


@checkpoint_block
class Block(nn.Module):
    def forward(self, x):
        return x


class Net(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.h = nn.ModuleList([Block() for _ in range(n)])

    def forward(self, x, skip_odd=False):
        for i, block in enumerate(self.h):
            if skip_odd and i % 2:
                continue
            elif i == 0:
                with contextlib.nullcontext():
                    x = block(x)  # first block
            else:
                x = block(x)
        return x
