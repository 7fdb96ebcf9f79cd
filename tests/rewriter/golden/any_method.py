"""dinov2's shape: the trunk loop lives in `forward_features`, the list is built from a
local comprehension of a factory whose class the source does not name, and a second
method loops over the same blocks collecting outputs."""
import torch
from torch import nn


class VisionTransformer(nn.Module):
    def __init__(self, depth, block_fn):
        super().__init__()
        blocks_list = [block_fn(dim=8) for i in range(depth)]
        self.blocks = nn.ModuleList(blocks_list)
        self.norm = nn.LayerNorm(8)

    def forward_features(self, x):
        x = self.norm(x)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)

    def get_intermediate_layers(self, x, n=1):
        output = []
        for i, blk in enumerate(self.blocks):
            x = blk(x)
            if i >= len(self.blocks) - n:
                output.append(x)
        return output

    def forward(self, x):
        return self.forward_features(x)
