"""x-transformers' shape: the layer loop reaches `self.layers` only through a local tuple
unpacked by `zip(*...)`, so the rewriter cannot tell which element is the block: the
loop is reported (neither wrapped nor proven safe), and the file is left as it is."""
from torch import nn


class Block(nn.Module):
    def forward(self, x):
        return x


class Norm(nn.Module):
    def forward(self, x):
        return x


class AttentionLayers(nn.Module):
    def __init__(self, depth):
        super().__init__()
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([Norm(), Block()]))
        self.layer_types = ("a",) * depth

    def forward(self, x):
        layer_variables = (self.layer_types, self.layers)
        layer_variables = tuple(tuple(v[i] for i in range(len(self.layers))) for v in layer_variables)
        for layer_type, (norm, block) in zip(*layer_variables):
            x = block(norm(x))
        return x
