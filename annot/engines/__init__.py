"""The engines: one module per engine, each an `annot.engines.base.Engine` with a frozen
options dataclass; `annot.wrap.auto_wrap` owns the order in which their steps run.

These modules import torch.distributed (and DeepSpeed inside functions), which
``import annot`` avoids. Engine internals (FSDP1's flat parameters, ZeRO-3's
``ds_tensor``, wrapper module names) are read only here.
"""
