"""Imports the emitted code needs: reused when present, added (and marked) when not."""

from __future__ import annotations

import pytest

IMPORTS = "from torch import nn\n\nfrom annot import checkpoint_block\n"
LOOP = "        for block in self.h:\n            x = block(x)\n        return x\n"


@pytest.fixture
def model(net_source) -> str:
    return net_source(IMPORTS, LOOP)


def test_existing_deepspeed_import_is_reused(rewrite, model) -> None:
    result = rewrite("import deepspeed\nimport torch\n" + model)
    assert result.imports_added == ()
    assert "deepspeed.checkpointing.non_reentrant_checkpoint(lambda block=block, x=x: block(x))" in result.code


def test_optional_dependency_import_is_kept(rewrite, model) -> None:
    optional = "try:\n    import deepspeed\nexcept ImportError:\n    deepspeed = None\n"
    result = rewrite("import torch\n" + optional + model)
    assert result.imports_added == ()  # no hard `import deepspeed` that would fail without it
    assert result.code.startswith("import torch\n" + optional)
    assert "deepspeed.checkpointing.non_reentrant_checkpoint(lambda block=block, x=x: block(x))" in result.code


def test_torch_alias_is_used_in_the_guard(rewrite, model) -> None:
    result = rewrite("import deepspeed\nimport torch as th\n" + model)
    assert "if self.training and th.is_grad_enabled():" in result.code


def test_missing_torch_is_imported_for_the_guard(rewrite, model) -> None:
    result = rewrite(model)
    assert result.imports_added == ("import deepspeed", "import torch")
    assert "import torch  # annot: import\n" in result.code


def test_name_taken_by_something_else_is_not_shadowed(rewrite, model) -> None:
    result = rewrite("import torch\ndeepspeed = 'a string the file uses'\n" + model)
    assert result.imports_added == ("import deepspeed as annot_deepspeed",)
    assert "annot_deepspeed.checkpointing.non_reentrant_checkpoint(lambda block=block, x=x: block(x))" in result.code


def test_torch_checkpoint_from_import_is_reused(rewrite, model) -> None:
    source = "import torch\nfrom torch.utils.checkpoint import checkpoint as ckpt\n" + model
    result = rewrite(source, "torch")
    assert result.imports_added == ()
    assert "ckpt(block, x, use_reentrant=False)" in result.code


def test_plain_import_torch_gets_the_checkpoint_submodule(rewrite, model) -> None:
    # `import torch` alone does not load torch.utils.checkpoint.
    result = rewrite("import torch\n" + model, "torch")
    assert result.imports_added == ("import torch.utils.checkpoint",)


def test_imports_go_after_the_last_module_level_import(rewrite, model) -> None:
    result = rewrite('"""Doc."""\nimport torch\n' + model)
    lines = result.code.splitlines()
    assert lines[lines.index("from annot import checkpoint_block") + 1] == (
        "import deepspeed  # annot: import"
    )
