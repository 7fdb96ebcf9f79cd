"""Which models get the hooks that keep a rank without an image in step with the others
(docs/design.md, pitfall 58): a tower is known by its role, a features method or a
media-named forward argument. Fuyu (no vision config, patches embedded by a Linear of
the root) and Phi-4-multimodal's naming (``image_pixel_values``) aborted a 2-rank run
with a collective mismatch before (the class sweep's mixed scenario); a text-only model
gets nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from annot.huggingface.modality_standin import ModalityStandIns, _media_arguments, install_stand_ins

transformers = pytest.importorskip("transformers")


def _tiny(kind: str, arch: str, tmp_path) -> nn.Module:
    from tests.huggingface.probe_classes import architectures, tiny_model

    return tiny_model(kind, arch, architectures(kind)[arch], tmp_path)


def test_fuyu_without_a_tower_role_gets_the_image_stand_in(tmp_path):
    from annot.policies.roles import TOWERS, module_roles

    model = _tiny("image_text", "fuyu", tmp_path)
    assert not any(role in TOWERS for role in module_roles(model).values())  # why it was missed
    installed = install_stand_ins(model, ordered_gathers=False)
    assert isinstance(installed, ModalityStandIns)
    assert [m.name for m in installed.modalities] == ["image"]


def test_media_named_arguments_without_a_features_method_install_the_refusal():
    class Reader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)

        def forward(self, input_ids: torch.Tensor, image_pixel_values: torch.Tensor | None = None,
                    image_sizes: torch.Tensor | None = None) -> torch.Tensor:
            return self.embed(input_ids)

    model = Reader()
    assert _media_arguments(model) == ("image_pixel_values", "image_sizes")
    installed = install_stand_ins(model, ordered_gathers=False)
    assert isinstance(installed, ModalityStandIns) and installed.modalities == []
    assert len(model._forward_pre_hooks) == 1  # the refusing hook


def test_a_text_only_model_gets_nothing():
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config)
    assert install_stand_ins(model, ordered_gathers=False) is None
    assert not model._forward_pre_hooks


def test_deepstack_pairs_go_to_their_layers_the_last_of_each_layer_only():
    """Granite-4-Vision's features method returns (language layer, features) pairs and the
    model keeps them in a dict by layer: of two pairs for one layer only the last reaches
    the model (the tiny config sends four spatial groups to layer 1), so only its
    stand-in gets a gradient; nothing else of the output is attached (no last hidden
    state: the model uses none). A pair naming a layer the model lacks leaves the
    output as it was: attached at the end."""
    from types import SimpleNamespace

    from annot.huggingface.modality_standin import _consumed, _injected

    a, b, c = (torch.ones(1, requires_grad=True) for _ in range(3))
    output = SimpleNamespace(deepstack_features=[(0, [a]), (1, [b]), (1, [c])], last_hidden_state=torch.ones(1))
    injected = _injected(output, layer_count=2)
    assert [(index, features[0] is expected) for (index, features), expected in zip(injected, (a, c), strict=True)] == \
        [(0, True), (1, True)]
    assert _consumed(output, injected=True) == []
    assert _injected(output, layer_count=1) == []  # layer 1 is not there
    qwen_like = SimpleNamespace(deepstack_features=[a, b], pooler_output=c)  # tensors, no layer pairs
    assert _injected(qwen_like, layer_count=2) == []
    assert _consumed(qwen_like) == [c, [a, b]]


class _ReadsImages(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.vision = nn.Linear(4, 4)

    def get_image_features(self, pixel_values: torch.Tensor, image_grid_hw: torch.Tensor | None = None
                           ) -> torch.Tensor:
        return self.vision(pixel_values)

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                image_grid_hw: torch.Tensor | None = None) -> torch.Tensor:
        return self.embed(input_ids)


def test_the_features_arguments_are_read_when_fsdp2_registered_the_method(one_rank):
    """FSDP2 registers the root's ``get_image_features`` (`ENTRY_METHODS`) as a wrapper
    whose bound signature lost its first argument: Nemotron-H-Omni's stand-in was sent
    no pixel values and its text-only rank raised while the other waited."""
    import annot

    model = annot.auto_wrap(_ReadsImages(), "fsdp2", annot.by_class(nn.Linear))
    installed = install_stand_ins(model, ordered_gathers=False)
    assert [(m.trigger, m.parameters) for m in installed.modalities] == \
        [("pixel_values", ("pixel_values", "image_grid_hw"))]


def test_the_default_plan_keeps_the_input_embeddings_module_with_the_root(tmp_path):
    """ModernVBERT's ``_no_split_modules`` makes its text embeddings a unit, and the model
    embeds through ``get_input_embeddings()`` before that unit runs: FSDP2 reduced the
    unit's gradients before the embedding's came (design pitfall 61). The default plan
    leaves that unit unsharded and says why; the text layers stay units."""
    import annot

    model = _tiny("masked_lm", "modernvbert", tmp_path)
    plan = annot.plan(model)
    sharded = [u.path for u in plan.units if "shard" in [a.value for a in u.actions]]
    assert "model.text_model.embeddings" not in sharded
    assert "model.text_model.layers.0" in sharded
    assert any("model.text_model.embeddings not sharded apart" in w for w in plan.warnings)
