import torch
from torch import nn

import annot
from annot import shard_block as sb


@annot.checkpoint_block
class Encoder(nn.Module):
    def forward(self, x):
        return x


@sb(checkpoint=True)
class Decoder(nn.Module):
    def forward(self, x):
        return x


@sb(enabled=False)
class Head(Decoder):
    def forward(self, x):
        return x


@annot.checkpoint_block(enabled=False)
class Off(nn.Module):
    def forward(self, x):
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.head = Head()
        self.off = Off()

    def forward(self, x):
        return self.head(self.decoder(self.off(self.encoder(x))))
