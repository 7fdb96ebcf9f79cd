"""A deprecated option passed through `annot.from_pretrained` (which hands it on to
`auto_wrap`) warns at the caller's line, not inside annot, so Python's default filters,
which show a `DeprecationWarning` only where it is attributed to ``__main__``, show it
to a script's author."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import annot

THIS_FILE = str(Path(__file__).resolve())


@pytest.mark.slow  # builds and saves a tiny Llama, then builds it again on the meta device
def test_from_pretrained_warns_at_the_callers_line(saved_models):
    with pytest.warns(DeprecationWarning, match="reshard_after_forward=True.*use stage=3") as caught:
        # no process group here: auto_wrap stops after building the options
        with pytest.raises(annot.ProcessGroupNotInitializedError):
            annot.from_pretrained(saved_models["llama"], "deepspeed", reshard_after_forward=True,
                                  optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert [w.filename for w in caught if w.category is DeprecationWarning] == [THIS_FILE]
