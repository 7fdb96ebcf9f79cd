"""timm's shape: each stage checkpoints its own blocks (behind its flag), so the call of
the stages is reported, not wrapped a second time; a plain stack elsewhere is wrapped."""
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential


class Block(nn.Module):
    def forward(self, x):
        return x


class Stage(nn.Module):
    def __init__(self, depth):
        super().__init__()
        self.grad_checkpointing = False
        self.blocks = nn.Sequential(*[Block() for _ in range(depth)])

    def forward(self, x):
        if self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_sequential(self.blocks, 2, x, use_reentrant=False)
        else:
            x = self.blocks(x)
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.Sequential()
        stages = [Stage(2) for _ in range(3)]
        self.stages = nn.Sequential(*stages)
        self.head = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        x = self.stages(x)
        for block in self.head:
            x = block(x)
        return x
