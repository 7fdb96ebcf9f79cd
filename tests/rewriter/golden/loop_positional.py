import torch
from torch import nn

from annot import checkpoint_block


@checkpoint_block
class Block(nn.Module):
    def forward(self, x, mask, scale, flag):
        return x


class Net(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.h = nn.ModuleList([Block() for _ in range(n)])

    def forward(self, x):
        for block in self.h:
            # extra positional arguments: None and non-tensors pass through
            x = block(x, None, 0.5, True)
        return x
