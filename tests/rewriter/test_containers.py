"""What `read_containers` records from an ``__init__``."""

from __future__ import annotations

import libcst as cst

from annot.rewriter.containers import read_containers
from annot.rewriter.imports import ImportTable

SOURCE = """\
from torch import nn

class Net(nn.Module):
    def __init__(self):
        self.blocks = nn.ModuleDict({"a": Block(), b"b": Block()})
"""


def test_module_dict_names_come_from_string_keys_only() -> None:
    module = cst.parse_module(SOURCE)
    cls = module.body[1]
    assert isinstance(cls, cst.ClassDef) and isinstance(cls.body, cst.IndentedBlock)
    init = cls.body.body[0]
    assert isinstance(init, cst.FunctionDef)
    # A bytes key names no submodule (ModuleDict refuses it); it used to give "blocks.b'b'".
    assert set(read_containers(module, ImportTable.of(module), [init])) == {"blocks", "blocks.a"}
