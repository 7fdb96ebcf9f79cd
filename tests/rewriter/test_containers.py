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


def _containers(source: str) -> dict:
    module = cst.parse_module(source)
    cls = module.body[-1]
    assert isinstance(cls, cst.ClassDef) and isinstance(cls.body, cst.IndentedBlock)
    methods = [m for m in cls.body.body if isinstance(m, cst.FunctionDef)]
    return read_containers(module, ImportTable.of(module), methods)


def test_an_empty_container_built_first_is_replaced_by_the_later_build() -> None:
    """timm builds `self.stages = nn.Sequential()` first, then the real stack: what the
    stack holds comes from the later build (was: no classes, merged with the empty one)."""
    [stages] = _containers(
        "from torch import nn\n\nclass Net(nn.Module):\n    def __init__(self):\n"
        "        self.stages = nn.Sequential()\n"
        "        stages = [Stage() for _ in range(3)]\n"
        "        self.stages = nn.Sequential(*stages)\n"
    ).values()
    assert (stages.kind, stages.classes, stages.repeated) == ("sequential", ("Stage",), True)


def test_two_real_builds_of_one_container_still_merge() -> None:
    [layers] = _containers(
        "from torch import nn\n\nclass Net(nn.Module):\n    def __init__(self, a):\n"
        "        if a:\n            self.layers = nn.ModuleList([A() for _ in range(2)])\n"
        "        else:\n            self.layers = nn.ModuleList([B() for _ in range(2)])\n"
    ).values()
    assert layers.classes == ("A", "B")
