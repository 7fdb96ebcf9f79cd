"""torchtitan's shape: an nn.ModuleDict filled by key in a loop, iterated by `.values()`;
and a ModuleDict of stages iterated by `.items()`."""
import torch
from torch import nn


class TransformerBlock(nn.Module):
    def forward(self, h, mask, freqs_cis):
        return h


class Transformer(nn.Module):
    def __init__(self, n_layers):
        super().__init__()
        self.layers = torch.nn.ModuleDict()
        for layer_id in range(n_layers):
            self.layers[str(layer_id)] = TransformerBlock()
        self.stages = nn.ModuleDict({"a": TransformerBlock(), "b": TransformerBlock()})

    def forward(self, tokens, mask, freqs_cis):
        h = tokens * 2
        for layer in self.layers.values():
            h = layer(h, mask, freqs_cis)
        for name, stage in self.stages.items():
            h = stage(h, mask, freqs_cis)
        return h
