"""One module per engine; each has one function that owns the order of steps.

`annot.wrap.auto_wrap` resolves the engine name and calls the function. These modules
import torch.distributed (and DeepSpeed inside functions), which `import annot` avoids.
"""
