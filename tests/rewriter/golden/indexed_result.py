import torch
from torch import nn

from annot import checkpoint_block


@checkpoint_block
class Layer(nn.Module):
    def forward(self, x):
        return (x,)


class Net(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            outputs = layer(x)
            x = outputs[0]
        for layer in self.layers:
            x = layer(x)[0]
        return x
