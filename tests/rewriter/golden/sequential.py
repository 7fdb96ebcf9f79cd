import torch
from torch import nn

from annot import shard_block


@shard_block(checkpoint=True)
class Block(nn.Module):
    def forward(self, x):
        return x


class Net(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(n)])
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        x = self.blocks(x)
        return self.norm(self.blocks(x))
