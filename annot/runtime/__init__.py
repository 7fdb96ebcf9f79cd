"""Run-time activation tools applied inside an engine's units: activation checkpointing
and activation offload. Both leave the module tree and parameter names unchanged."""
