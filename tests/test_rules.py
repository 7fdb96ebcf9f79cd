"""Each rule, the combinators and the rule-expression parser."""

from __future__ import annotations

import re

import pytest
from torch import nn

from annot.policies import (
    by_class,
    by_name,
    by_size,
    every_nth,
    marked,
    no_split_modules,
    parse_rule,
    repeated_blocks,
)
from annot.policies.model_index import ModelIndex
from annot.policies.parse import PolicySyntaxError, parse_count
from examples.gpt.model import Block

BLOCKS = ["transformer.h.0", "transformer.h.1", "transformer.h.2"]


def select(rule, model):
    return rule.select(ModelIndex(model))


def test_by_class_accepts_types_bare_and_dotted_names(gpt_meta):
    assert list(select(by_class(Block), gpt_meta)) == BLOCKS
    assert list(select(by_class("Block"), gpt_meta)) == BLOCKS
    assert list(select(by_class("examples.gpt.model.Block"), gpt_meta)) == BLOCKS
    assert select(by_class(Block), gpt_meta)["transformer.h.0"] == "class(Block)"


def test_by_class_name_matches_subclasses_like_isinstance():
    class Base(nn.Module):
        pass

    class Derived(Base):
        pass

    model = nn.Sequential(Base(), Derived())
    assert list(select(by_class("Base"), model)) == ["0", "1"]


def test_by_class_rejects_non_module_types():
    with pytest.raises(TypeError):
        by_class(int)
    with pytest.raises(ValueError):
        by_class()


def test_by_name_glob_and_regex(gpt_meta):
    assert list(select(by_name("transformer.h.*"), gpt_meta)) == BLOCKS
    assert "transformer.h.0.attn.c_attn" in select(by_name("**.c_attn"), gpt_meta)
    assert list(select(by_name("transformer.h.?"), gpt_meta)) == BLOCKS
    assert list(select(by_name("re:transformer\\.h\\.[02]"), gpt_meta)) == [BLOCKS[0], BLOCKS[2]]
    assert list(select(by_name("lm_head"), gpt_meta)) == ["lm_head"]
    with pytest.raises(ValueError, match="bad regular expression"):
        by_name("re:(")


def test_by_size_is_bottom_up():
    model = nn.Sequential(
        nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10)),  # 110 each
        nn.Linear(2, 2),
    )
    # Each Linear(10,10) holds 110 >= 100: selected; their parent then holds nothing new.
    assert list(select(by_size(100), model)) == ["0.0", "0.1"]
    # At 200, no single linear qualifies, their parent (220) does; root is never selected.
    assert list(select(by_size(200), model)) == ["0"]
    assert select(by_size(200), model)["0"] == "size(>=200)"
    with pytest.raises(ValueError):
        by_size(0)


def test_every_nth_counts_in_model_order(gpt_meta):
    assert list(select(every_nth(2, by_class(Block)), gpt_meta)) == [BLOCKS[0], BLOCKS[2]]
    assert list(select(every_nth(2, by_class(Block), offset=1), gpt_meta)) == [BLOCKS[1]]
    with pytest.raises(ValueError):
        every_nth(2, by_class(Block), offset=2)


def test_marked_reads_class_and_instance_marks(gpt_meta):
    assert list(select(marked("shard"), gpt_meta)) == BLOCKS
    assert list(select(marked("offload"), gpt_meta)) == []
    from annot import mark

    mark(gpt_meta.transformer.h[1], offload="nvme")
    assert list(select(marked("offload"), gpt_meta)) == [BLOCKS[1]]


class Leaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)


class Inner(nn.Module):
    _no_split_modules = ["Leaf"]

    def __init__(self) -> None:
        super().__init__()
        self.leaves = nn.ModuleList([Leaf(), Leaf()])


class Outer(nn.Module):
    _no_split_modules = ["Missing"]

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()


def test_no_split_modules_honours_children_and_reports_absent_names():
    model = Outer()
    index = ModelIndex(model)
    rule = no_split_modules()
    assert list(rule.select(index)) == ["inner.leaves.0", "inner.leaves.1"]
    assert rule.diagnostics(index) == [
        "_no_split_modules names 'Missing', which does not occur in this model"
    ]


def test_no_split_modules_on_a_transformers_model(tiny_llama_meta):
    selected = select(no_split_modules(), tiny_llama_meta)
    assert list(selected) == ["model.layers.0", "model.layers.1"]
    assert selected["model.layers.0"] == "no_split_modules(LlamaDecoderLayer)"


def test_repeated_blocks_finds_the_trunk(gpt_meta):
    assert list(select(repeated_blocks(), gpt_meta)) == BLOCKS


def test_union_intersection_difference(gpt_meta):
    union = by_class(Block) | by_name("lm_head")
    assert list(select(union, gpt_meta)) == [*BLOCKS, "lm_head"]
    assert union.name == "class(Block) | name(lm_head)"
    both = by_class(Block) & by_name("*.h.1")
    assert select(both, gpt_meta) == {BLOCKS[1]: "class(Block) & name(*.h.1)"}
    minus = by_class(Block) - by_name("*.h.0")
    assert list(select(minus, gpt_meta)) == BLOCKS[1:]
    nested = (by_class(Block) | by_name("lm_head")) - by_name("lm_head")
    assert nested.name == "(class(Block) | name(lm_head)) - name(lm_head)"
    assert list(select(nested, gpt_meta)) == BLOCKS


def test_union_reason_names_every_matching_rule(gpt_meta):
    rule = by_class(Block) | by_name("transformer.h.0")
    assert select(rule, gpt_meta)[BLOCKS[0]] == "class(Block) | name(transformer.h.0)"


def test_rules_only_combine_with_rules():
    with pytest.raises(TypeError):
        by_class(Block) | "lm_head"  # type: ignore[operator]


@pytest.mark.parametrize(
    "text, name",
    [
        ("class:Block", "class(Block)"),
        ("class:Block,MLP", "class(Block, MLP)"),
        ("name:transformer.h.*", "name(transformer.h.*)"),
        ("size:100M", "size(>=100M)"),
        ("marked:checkpoint", "marked(checkpoint)"),
        ("marked", "marked"),
        ("hf", "no_split_modules"),
        ("repeated", "repeated_blocks"),
        ("every(2, class:Block)", "every_nth(2, class(Block))"),
        ("every(2,class:Block)", "every_nth(2, class(Block))"),
        ("class:Block | name:lm_head & size:1K", "class(Block) | (name(lm_head) & size(>=1K))"),
        ("(class:Block | name:lm_head) - name:*.h.0", "(class(Block) | name(lm_head)) - name(*.h.0)"),
    ],
)
def test_parse_rule(text, name):
    assert parse_rule(text).name == name


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty rule"),
        ("klass:Block", "unknown rule 'klass:Block'"),
        ("class:Block |", "expected more"),
        ("(class:Block", "expected ')'"),
        ("every(0, class:Block)", "needs N >= 1"),
        ("size:lots", "not a parameter count"),
        ("class:Block )", "unexpected ')'"),
        ("marked:sideways", "'sideways' is not a valid Action"),
    ],
)
def test_parse_rule_errors(text, message):
    with pytest.raises(PolicySyntaxError, match=re.escape(message)):
        parse_rule(text)


def test_parse_count():
    assert parse_count("100M") == 100_000_000
    assert parse_count("1e8") == 100_000_000
    assert parse_count("2.5k") == 2500
    assert parse_count("5000") == 5000
