import torch
from torch import nn

from annot import checkpoint_block


@checkpoint_block
class Block(nn.Module):
    def forward(self, x, cache=None):
        return x


class Net(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(n)])

    def forward(self, x, caches):
        for i, block in enumerate(self.blocks):
            x = block(x) * (i + 1)
        for block, cache in zip(self.blocks, caches):
            x = block(x, cache)
        for i in range(len(self.blocks)):
            x = self.blocks[i](x)
        return x
