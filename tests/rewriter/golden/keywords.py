import torch
from torch import nn

from annot import checkpoint_block


@checkpoint_block
class DecoderLayer(nn.Module):
    def forward(self, hidden_states, attention_mask=None, use_reentrant=None, **kwargs):
        return hidden_states


class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [DecoderLayer() for _ in range(config.num_hidden_layers)]
        )

    def forward(self, hidden_states, attention_mask, **kwargs):
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=attention_mask,
                use_reentrant="a name torch's checkpoint would swallow",
                **kwargs,
            )
        return hidden_states
