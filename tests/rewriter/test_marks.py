"""Which classes are blocks: marks under any alias, across files, on and off."""

from __future__ import annotations

from annot.rewriter import marked_classes


def test_bare_and_called_markers() -> None:
    source = (
        "from annot import checkpoint_block, shard_block\n"
        "@checkpoint_block\nclass A: ...\n"
        "@shard_block(checkpoint=True)\nclass B: ...\n"
        "@shard_block\nclass C: ...\n"
    )
    assert marked_classes(source) == {"A", "B"}


def test_import_aliases() -> None:
    source = (
        "import annot\nfrom annot import shard_block as sb\n"
        "@annot.checkpoint_block\nclass A: ...\n"
        "@sb(checkpoint=True)\nclass B: ...\n"
    )
    assert marked_classes(source) == {"A", "B"}


def test_enabled_false_turns_a_mark_off() -> None:
    source = (
        "from annot import checkpoint_block, shard_block\n"
        "@checkpoint_block\nclass A: ...\n"
        "@checkpoint_block(enabled=False)\nclass B(A): ...\n"
        "@shard_block(enabled=False)\nclass C(A): ...\n"
    )
    assert marked_classes(source) == {"A"}


def test_subclass_inherits_across_files() -> None:
    base = "from annot import checkpoint_block\n@checkpoint_block\nclass Block: ...\n"
    derived = "from .base import Block\nclass Wide(Block): ...\n"
    assert marked_classes(base, derived) == {"Block", "Wide"}


def test_a_same_named_function_from_elsewhere_is_not_a_marker() -> None:
    source = "from mylib import checkpoint_block\n@checkpoint_block\nclass A: ...\n"
    assert marked_classes(source) == frozenset()
