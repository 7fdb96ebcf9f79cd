"""vit-pytorch's shape: a ModuleList of ModuleLists appended in a loop and unpacked by
`for attn, ff in self.layers`, residual adds around the calls."""
import torch
from torch import nn
from torch.nn import Module, ModuleList


class Attention(Module):
    def forward(self, x):
        return x


class FeedForward(Module):
    def forward(self, x):
        return x


class Transformer(Module):
    def __init__(self, depth):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.layers = ModuleList([])
        for _ in range(depth):
            self.layers.append(ModuleList([
                Attention(),
                FeedForward()
            ]))

    def forward(self, x):
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        return self.norm(x)
