"""Whether the code running now is already under someone else's activation checkpoint.

annot's run-time checkpointing and activation offload both ask this before acting on a
unit's forward, so that a model whose source already checkpoints its blocks (``annot
rewrite``, a hand-written ``torch.utils.checkpoint`` call, HuggingFace's
``gradient_checkpointing_enable``) is not checkpointed a second time, and so that offload
hooks never sit on top of a checkpoint's own saved-tensor hooks (which would keep, on the
host, what the checkpoint means to drop).

Detection is per call and costs two C calls. What it recognises:

- any recomputation running inside backward (torch's non-reentrant and reentrant
  checkpoint, DeepSpeed's): autograd's current graph task id is set;
- the first forward under torch's non-reentrant checkpoint, or DeepSpeed's
  ``non_reentrant_checkpoint`` (what ``annot rewrite --target deepspeed`` writes): the
  innermost saved-tensor hooks are the checkpoint's own (defined in
  ``torch.utils.checkpoint`` / DeepSpeed's checkpointing module);
- the first forward under a reentrant checkpoint (torch ``use_reentrant=True``,
  DeepSpeed's) runs with autograd off, which callers already treat as "nothing to do".

Limits: a third party's saved-tensor hooks pushed *inside* a torch checkpoint hide it
(the unit is then checkpointed once more: correct numbers, one more recomputation); a
forward that a user deliberately runs inside a backward hook is treated as a
recomputation. ``torch._C._autograd._top_saved_tensors_default_hooks`` and
``torch._C._current_graph_task_id`` are private torch APIs, stable since torch 2.0.

Under ``torch.compile`` neither can be traced (each call is a graph break: 4 per
checkpointed forward, and ``fullgraph=True`` fails); declaring the test a constant for
dynamo (``torch.compiler.assume_constant_result``) would bake its first answer into the
graph with no guard. So run-time checkpointing does not ask while dynamo traces
(``torch.compiler.is_compiling()``, constant-folded) and always checkpoints a training
forward. Gradients are unchanged in every case; what an outer checkpoint costs then
(measured on torch 2.13, CPU):

- the outer checkpoint traced in the same compiled graph (the whole model compiled, its
  source calling ``torch.utils.checkpoint``): the two regions nest and the compiled
  backward recomputes the block once, exactly as without annot's checkpoint;
- a compiled block called under an eager outer checkpoint (a hand-written or
  HuggingFace checkpoint around a block compiled on its own, either kind): the outer one
  reruns the block's compiled forward and the block's compiled backward recomputes it
  once more (5 of the GPT block's 6 matmuls: one extra, partial, forward per step), and
  no warning is given. Pass ``checkpoint=False`` to ``auto_wrap`` when the model
  checkpoints its own blocks.

Activation offload's hooks are kept out of compiled code (`annot.runtime.activation_offload`),
so they still ask, eagerly, around a compiled forward.
"""

from __future__ import annotations

import torch

__all__ = ["in_backward", "under_outer_checkpoint"]

# The modules that define torch's and DeepSpeed's non-reentrant checkpoint hooks (their
# pack hooks are closures there).
_CHECKPOINT_HOOK_MODULES = {
    "torch.utils.checkpoint",
    "deepspeed.runtime.activation_checkpointing.checkpointing",
}


def in_backward() -> bool:
    """True while autograd runs a backward pass (a checkpoint's recomputation included)."""
    return torch._C._current_graph_task_id() != -1


def under_outer_checkpoint() -> bool:
    """True while a forward runs under an activation checkpoint someone else set up:
    torch's or DeepSpeed's non-reentrant checkpoint (first pass), or any recomputation in
    backward."""
    if in_backward():
        return True
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        return False
    return getattr(top[0], "__module__", None) in _CHECKPOINT_HOOK_MODULES
