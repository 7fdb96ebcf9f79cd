"""litgpt's shape: the trunk's block holds an MoE whose experts are looped over; only the
trunk is checkpointed (outermost wins), the expert loop and a helper MLP of torch.nn
layers are reported, not wrapped."""
import torch
from torch import nn


class Expert(nn.Module):
    def forward(self, x):
        return x


class MoE(nn.Module):
    def __init__(self, n_expert):
        super().__init__()
        self.experts = nn.ModuleList(Expert() for _ in range(n_expert))

    def forward(self, x):
        out = torch.zeros_like(x)
        for expert in self.experts:
            out = out + expert(x)
        return out


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MoE(4)

    def forward(self, x):
        return x + self.mlp(x)


class PositionBias(nn.Module):
    def __init__(self, depth):
        super().__init__()
        self.mlp = nn.ModuleList([])
        for _ in range(depth):
            self.mlp.append(nn.Sequential(nn.Linear(8, 8), nn.SiLU()))
        self.mlp.append(nn.Linear(8, 2))

    def forward(self, n):
        pos = torch.arange(n).float()
        for layer in self.mlp:
            pos = layer(pos)
        return pos


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.h = nn.ModuleList([Block() for _ in range(config.n_layer)])
        self.bias = PositionBias(2)

    def forward(self, x):
        x = x + self.bias(x.shape[1])
        for block in self.h:
            x = block(x)
        return x
