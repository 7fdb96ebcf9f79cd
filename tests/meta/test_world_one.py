"""Meta init at world size 1, in this process (a one-rank gloo group). FSDP1 switches
to NO_SHARD there, so each original parameter keeps its own shape instead of being a
1-D piece of a flat shard: the fill must still land (found by the first GPU run of
``python -m annot.verify``, row planner_world1, and reproduced on the CPU)."""

from __future__ import annotations

import pytest
import torch

from annot.meta.deferred import meta_init
from annot.verify.model import Shape, TinyGPT
from annot.wrap import auto_wrap

SHAPE = Shape(vocab=96, block=16, layers=2, heads=2, width=16)


@pytest.mark.parametrize("engine", ["fsdp1", "fsdp2"])
def test_meta_init_at_world_one_equals_the_eager_build(one_rank, engine):
    torch.manual_seed(3)
    eager = {n: p.detach().clone() for n, p in TinyGPT(SHAPE).named_parameters()}
    torch.manual_seed(3)
    with meta_init():
        model = TinyGPT(SHAPE)
    wrapped = auto_wrap(model, engine, checkpoint=False)
    with torch.no_grad():
        got = {n.replace("_fsdp_wrapped_module.", ""): (p.full_tensor() if hasattr(p, "full_tensor") else p)
               for n, p in wrapped.named_parameters()}
    assert got.keys() == eager.keys()
    differing = [n for n in eager if not torch.equal(got[n].reshape(eager[n].shape), eager[n])]
    assert not differing
