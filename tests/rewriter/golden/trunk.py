"""No marks: the trunk is chosen (repeated layers in a ModuleList or Sequential)."""
import torch
from torch import nn


class Layer(nn.Module):
    def forward(self, x):
        return x


class Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(config.n_layer):
            self.layers.append(Layer())
        self.stages = nn.Sequential(*[Layer() for _ in range(config.n_stage)])
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

    def forward(self, x):
        x = self.mlp(x)
        for layer in self.layers:
            x = layer(x)
        return self.stages(x)
