"""Calls passing a KV cache: checkpointed only when the cache is off at run time."""
import torch
from torch import nn


class DecoderLayer(nn.Module):
    def forward(self, hidden_states, past_key_values=None, use_cache=False, **kwargs):
        return hidden_states


class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [DecoderLayer() for _ in range(config.num_hidden_layers)]
        )

    def forward(self, inputs_embeds, past_key_values=None, use_cache=None, **kwargs):
        hidden_states = inputs_embeds
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                past_key_values=past_key_values,
                use_cache=use_cache,
                **kwargs,
            )
        for i, block in enumerate(self.layers):
            hidden_states = block(
                hidden_states,
                past_key_values if not (self.gradient_checkpointing and self.training) else None,
                use_cache=False,
            )
        for layer in self.layers:
            hidden_states = layer(hidden_states, use_cache=True)
        return hidden_states
