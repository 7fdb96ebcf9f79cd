"""What the rewriter reports instead of wrapping (issue #33): MoE expert dispatch, calls
already checkpointed inside their own class, layer loops it cannot follow, and wrapped
calls whose cache guard is off by default in training."""

from __future__ import annotations

from pathlib import Path

import pytest

from annot.rewriter import rewrite_source
from annot.rewriter.cli import main

GOLDEN = Path(__file__).parent / "golden"


def _golden(case: str) -> str:
    return (GOLDEN / f"{case}.py").read_text(encoding="utf-8")


# -- MoE expert dispatch -------------------------------------------------------------------


def test_a_routed_dispatch_loop_is_reported_by_its_shape(target: str) -> None:
    """Nothing names the experts: routed inputs (`x[token_idx]`) scattered back into an
    indexed target are enough."""
    result = rewrite_source(_golden("moe_dispatch"), target=target)
    [skip] = [s for s in result.skipped if s.function == "Routed.forward"]
    assert skip.block == "ffn"
    assert skip.reason.startswith(
        "an MoE expert dispatch (each element runs on the tokens routed to it and its output "
        "is scattered back)"
    )
    assert [s.function for s in result.wrapped] == ["GPT.forward"]


def test_a_loop_over_experts_named_so_is_reported(rewrite, target) -> None:
    source = """\
        from torch import nn

        class MLP(nn.Module):
            def forward(self, x):
                return x

        class MoE(nn.Module):
            def __init__(self):
                super().__init__()
                self.local_experts = nn.ModuleList([MLP() for _ in range(4)])

            def forward(self, x):
                out = 0
                for expert in self.local_experts:
                    out = out + expert(x)
                return out
        """
    result = rewrite(source, target)
    assert not result.changed
    [skip] = result.skipped
    assert skip.reason.startswith("an MoE expert dispatch (`self.local_experts` holds MoE experts)")


def test_blocks_naming_the_experts_still_wraps_them(target: str) -> None:
    """Marks and --blocks are the user's choice: the dispatch is wrapped then."""
    result = rewrite_source(_golden("moe_dispatch"), target=target, blocks={"FFN"})
    assert [(s.function, s.block) for s in result.wrapped] == [("Routed.forward", "ffn")]


def test_a_plain_stack_with_indexed_inputs_is_still_wrapped(rewrite, target) -> None:
    """Routing needs both halves: an indexed input alone (`x[:, i]`) is no dispatch."""
    source = """\
        from torch import nn

        class Block(nn.Module):
            def forward(self, x):
                return x

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.h = nn.ModuleList([Block() for _ in range(2)])

            def forward(self, x, idx):
                for block in self.h:
                    x = block(x[idx])
                return x
        """
    assert len(rewrite(source, target).wrapped) == 1


# -- checkpointed inside its own class ----------------------------------------------------


def test_a_call_of_a_class_that_checkpoints_its_children_is_reported(target: str) -> None:
    result = rewrite_source(_golden("checkpointed_inside"), target=target)
    [skip] = [s for s in result.skipped if s.function == "Net.forward"]
    assert skip.block == "self.stages" and not skip.unprotected
    assert skip.reason.startswith(
        "already checkpointed inside its own class (Stage: `checkpoint_sequential(self.blocks, 2, "
        "x, use_reentrant=False)` in Stage.forward, when `self.grad_checkpointing and not "
        "torch.jit.is_scripting()`)"
    )
    assert [s.block for s in result.wrapped] == ["block"]  # the plain stack beside it


# -- loops it cannot follow ---------------------------------------------------------------


def test_a_loop_reaching_the_stack_through_locals_is_reported(target: str) -> None:
    source = _golden("indirect_loop")
    result = rewrite_source(source, target=target)
    assert result.code == source and not result.wrapped
    [skip] = result.skipped
    assert skip.block == "loop over self.layers"
    assert skip.reason.startswith("iterates self.layers through `zip(*layer_variables)`, which annot cannot follow")


def test_check_fails_where_a_selected_block_is_in_a_loop_it_cannot_follow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "model.py"
    path.write_text(_golden("indirect_loop"), encoding="utf-8")
    assert main([str(path), "--check", "--blocks", "Norm,Block", "-j", "1"]) == 1
    assert "selected blocks called where they cannot be wrapped" in capsys.readouterr().err


def test_a_loop_that_calls_nothing_it_binds_is_not_reported(rewrite, target) -> None:
    source = """\
        from torch import nn

        class Block(nn.Module):
            def forward(self, x):
                return x

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.h = nn.ModuleList([Block() for _ in range(2)])

            def forward(self, x):
                names = [str(b) for b in self.h]
                for name in names:
                    print(name)
                return x
        """
    result = rewrite(source, target)
    assert not result.skipped and not result.wrapped


# -- a cache guard that is off by default in training -------------------------------------

CACHE_MODEL = """\
from torch import nn
{imports}

class Block(nn.Module):
    def forward(self, x, use_cache=False):
        return x


class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([Block() for _ in range(2)])

{decorator}    def forward(self, x, use_cache={default}):
{fallback}        for layer in self.layers:
            x = layer(x, use_cache=use_cache)
        return x
"""


def _cache_model(default: str = "None", decorator: str = "", fallback: str = "", imports: str = "") -> str:
    return CACHE_MODEL.format(default=default, decorator=decorator, fallback=fallback, imports=imports)


@pytest.mark.parametrize(
    "source, why",
    [
        (_cache_model(default="True"), "`use_cache` defaults to True in forward()"),
        (
            _cache_model(
                decorator="    @merge_with_config_defaults\n",
                imports="from transformers.utils.generic import merge_with_config_defaults",
            ),
            "`use_cache=None` is filled from the config (merge_with_config_defaults), and "
            "transformers' configs set use_cache=True",
        ),
        (
            _cache_model(fallback="        use_cache = use_cache if use_cache is not None else self.config.use_cache\n"),
            "`use_cache` falls back to config.use_cache, and transformers' configs set use_cache=True",
        ),
    ],
    ids=["default-true", "config-defaults-decorator", "config-fallback"],
)
def test_a_guard_on_a_cache_flag_on_by_default_is_flagged(source: str, why: str, target: str) -> None:
    [site] = rewrite_source(source, target=target).wrapped
    assert site.cache_flag_on == why


@pytest.mark.parametrize("default", ["False", "None"])
def test_a_flag_off_unless_asked_is_not_flagged(default: str, target: str) -> None:
    [site] = rewrite_source(_cache_model(default=default), target=target).wrapped
    assert site.warning is not None  # the guard tests the flag all the same
    assert site.cache_flag_on is None


def test_the_cli_says_training_must_pass_use_cache_false(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "model.py"
    path.write_text(_cache_model(default="True"), encoding="utf-8")
    assert main([str(path), "-j", "1"]) == 0  # said without -v; the rewrite itself succeeds
    notes = [line for line in capsys.readouterr().err.splitlines() if ": note: " in line]
    assert notes == [
        f"{path}:17:17: note: layer(...) in Model.forward is checkpointed only while use_cache is "
        "off, and it is on by default (`use_cache` defaults to True in forward()): training must "
        "pass use_cache=False (annot's prepare_for_training does), or the guard skips recompute "
        "and nothing here is checkpointed"
    ]


def _indexed_through_a_local(attribute: str) -> str:
    return f"""\
        from torch import nn

        class Block(nn.Module):
            def forward(self, x):
                return x

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.{attribute} = nn.ModuleList([Block() for _ in range(2)])

            def forward(self, x):
                for i in range(len(self.{attribute})):
                    layer = self.{attribute}[i]
                    x = layer(x)
                return x
        """


def test_a_loop_calling_an_element_taken_into_a_local_is_reported(rewrite, target) -> None:
    result = rewrite(_indexed_through_a_local("layers"), target)
    assert not result.wrapped
    [skip] = result.skipped
    assert skip.reason.startswith("iterates self.layers through `range(len(self.layers))`, which annot cannot follow")


def test_an_expert_loop_through_a_local_is_reported_as_a_dispatch(rewrite, target) -> None:
    result = rewrite(_indexed_through_a_local("experts"), target)
    [skip] = result.skipped
    assert skip.reason == (
        "iterates self.experts through `range(len(self.experts))`: an MoE expert dispatch "
        "(`self.experts` holds MoE experts): checkpoint the layer holding the MoE, not each expert"
    )
