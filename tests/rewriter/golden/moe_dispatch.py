"""litgpt's MoE shape where the source does not say the block holds the MoE (the MLP class
comes from the config) and nothing names the experts: each element of `self.ffns` runs on
the tokens routed to it and its output is scattered back. Only the trunk is wrapped; the
dispatch loop is reported, not wrapped."""
import torch
from torch import nn


class FFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


class Routed(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.gate = nn.Linear(8, n, bias=False)
        self.ffns = nn.ModuleList(FFN() for _ in range(n))

    def forward(self, x):
        probs, indices = torch.topk(self.gate(x), 1)
        masks = indices.unsqueeze(-1) == torch.arange(len(self.ffns))
        y = torch.zeros_like(x)
        for mask, ffn in zip(masks.permute(2, 0, 1), self.ffns):
            token_idx, slot = torch.where(mask)
            y[token_idx] += probs[token_idx, slot, None] * ffn(x[token_idx])
        return y


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.mlp = config.mlp_class(len(config.experts))

    def forward(self, x):
        return x + self.mlp(x)


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return x
