import torch
from torch import nn

from annot import checkpoint_block


@checkpoint_block
class Block(nn.Module):
    def forward(self, x, aux):
        return x, aux


class Net(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(n)])

    def forward(self, x, aux):
        for layer in self.layers:
            x, aux = layer(x, aux)
        return x + aux
