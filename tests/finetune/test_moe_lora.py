"""LoRA on fused mixture-of-experts weights (PEFT's ``target_parameters``) through
`annot.from_pretrained`: a transformers-5 checkpoint (one key per expert, fused on load
through transformers' converters onto PEFT's wrapped names) and the same weights saved
fused by `annot.save` load bitwise as PEFT over transformers loads them, never with the
experts left at their initialization, and FSDP2 on 2 ranks trains the adapters like one
process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import annot
from tests.distributed import torchrun

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("moe_lora_worker.py")
SEED = 11
# Three steps of plain SGD on 4 rows each; a rank trains on its own rows.
BATCHES = [torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(5 + i)) for i in range(3)]
TOLERANCE = 1e-6  # fp32: what is left is the order of additions in the reductions


def lora_on_experts():
    """LoRA on attention and on both fused expert tensors, B drawn too (not zero), so
    every adapter changes the loss from the first step."""
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False,
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def rows_of(rank: int, world: int) -> slice:
    per = BATCHES[0].shape[0] // world
    return slice(rank * per, (rank + 1) * per)


def train(model: torch.nn.Module, rows: slice) -> list[float]:
    model.train()
    torch.manual_seed(SEED)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses = []
    for batch in BATCHES:
        x = batch[rows]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen3-MoE as transformers 5 saves it (per-expert keys), and the same
    weights as `annot.save` writes them (the model's fused names)."""
    root = tmp_path_factory.mktemp("moe-lora")
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(root / "per-expert")
    annot.save(annot.from_pretrained(root / "per-expert", engine=None), root / "fused")
    return root / "per-expert", root / "fused"


@pytest.mark.parametrize("which", ["per-expert", "fused"])
def test_checkpoint_loads_and_steps_as_peft_over_transformers(checkpoints, which):
    # Before: a per-expert checkpoint was refused by name; earlier still, strict=False
    # loaded it with the fused experts left at their random initialization.
    torch.manual_seed(SEED)
    path = checkpoints[0] if which == "per-expert" else checkpoints[1]
    loaded = annot.from_pretrained(path, engine=None, peft_config=lora_on_experts(), strict=True)
    torch.manual_seed(SEED)
    reference = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(checkpoints[0]),
                                    lora_on_experts())
    got, want = loaded.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    assert any(".experts.base_layer.base_layer.gate_up_proj" in k for k in got)  # wrapped twice
    for name in got:
        assert torch.equal(got[name], want[name]), name
    assert train(loaded, slice(None)) == train(reference, slice(None))
    for (name, a), (_, b) in zip(loaded.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.distributed
def test_fsdp2_on_two_ranks_trains_the_expert_adapters_like_one_process(checkpoints, tmp_path):
    """From the per-expert checkpoint (transformers' own format: each rank reads its
    experts' keys into the wrapped stacks)."""
    out = tmp_path / "result.pt"
    torchrun(WORKER, str(checkpoints[0]), str(out))
    result = torch.load(out, weights_only=False)
    torch.manual_seed(SEED)
    model = annot.from_pretrained(checkpoints[1], engine=None, peft_config=lora_on_experts())
    losses = train(model, slice(None))
    want = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    assert any(".experts.lora_A." in n for n in want) and len(want) == 12
    assert result["trained"].keys() == want.keys()
    torch.testing.assert_close(result["losses"], losses, rtol=TOLERANCE, atol=0)
    for name, value in want.items():
        torch.testing.assert_close(result["trained"][name], value, rtol=0, atol=TOLERANCE, msg=name)
