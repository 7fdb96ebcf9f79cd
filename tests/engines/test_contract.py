"""The engine contract (`annot.engines.base`): every engine through one training loop,
its options type, and the one state object annot keeps on a module. One rank, in this
process; the 2-rank parity tests compare the same surface against a reference."""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist

import annot
from annot.engines.registry import get_engine
from examples.gpt.model import GPT

pytestmark = pytest.mark.distributed

ENGINES = ["fsdp2", "fsdp1", "ddp", "deepspeed"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def one_rank(monkeypatch):
    # What torchrun would set; DeepSpeed reads LOCAL_RANK itself.
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def small_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train(step_fn, steps: int = 3) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 64, (2, 16), generator=gen)
        losses.append(step_fn(idx))
    return losses


def reference_losses() -> list[float]:
    model = small_gpt()
    opt = sgd(model.parameters())

    def step(idx: torch.Tensor) -> float:
        _, loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return train(step)


@pytest.mark.parametrize("engine", ENGINES)
def test_one_loop_trains_every_engine_like_plain_torch(one_rank, engine):
    trainer = annot.auto_wrap(small_gpt(), engine, checkpoint=True, optimizer=sgd)
    assert isinstance(trainer, annot.Trainable)

    def step(idx: torch.Tensor) -> float:
        _, loss = trainer(idx, idx)
        trainer.backward(loss)
        trainer.step()
        trainer.zero_grad()
        return loss.item()

    # fp32, one rank: the engines' only differences are float summation order.
    assert train(step) == pytest.approx(reference_losses(), abs=1e-6)
    # Parameter names are the bare model's; FSDP1 alone inserts its own wrapper level.
    names = [n.replace("_fsdp_wrapped_module.", "") for n, _ in trainer.model.named_parameters()]
    assert names == [n for n, _ in small_gpt().named_parameters()]


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_has_a_frozen_options_type_that_names_its_fields(engine):
    options_type = get_engine(engine).Options
    options = options_type()
    with pytest.raises(AttributeError):  # frozen dataclass: options never change mid-run
        options.__setattr__("bogus", 1)
    with pytest.raises(TypeError, match=f"engine '{engine}' has no option 'bogus'; it takes"):
        get_engine(engine).options(None, bogus=1)


def test_run_time_state_is_one_attribute_per_module(one_rank):
    torch.manual_seed(0)
    with annot.meta_init():
        model = GPT(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)
    annot.auto_wrap(model, "fsdp2", checkpoint=True, offload_activations=True)
    holders = {path for path, m in model.named_modules() if "_annot_state" in vars(m)}
    added = {key for m in model.modules() for key in vars(m) if "annot" in key}
    assert added == {"_annot_state"}  # the Block class's mark lives on the class
    # The construction record on the root; checkpointing and offload on each block.
    assert holders == {"", "transformer.h.0", "transformer.h.1"}


def test_a_deep_copy_keeps_checkpointing_bound_to_the_copy(one_rank):
    from annot.runtime.activation_checkpoint import apply_checkpointing, is_checkpointed

    model = small_gpt()
    apply_checkpointing(model, ["transformer.h.0"])
    twin = copy.deepcopy(model)
    block = twin.transformer.h[0]
    assert is_checkpointed(block)
    assert block.__dict__["_annot_state"].original_forward.__self__ is block


@pytest.mark.parametrize(("engine", "options", "error"), [
    ("fsdp1", dict(offload=True, device="cpu"), annot.EngineNotAvailableError),  # needs a GPU
    ("deepspeed", dict(stage=2, leaf_modules=["MLP"]), ValueError),  # a ZeRO-3 setting
    ("fsdp2", dict(offload="nvme"), annot.EngineNotAvailableError),
])
def test_a_refusal_leaves_the_model_as_it_was(one_rank, engine, options, error):
    model = small_gpt()
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    with pytest.raises(error):
        annot.auto_wrap(model, engine, checkpoint=True, optimizer=sgd, **options)
    assert not any("_annot_state" in vars(m) for m in model.modules())  # nothing installed
    assert {n: p for n, p in model.state_dict().items()}.keys() == before.keys()
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())
