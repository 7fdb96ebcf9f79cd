"""Checkpoint I/O: safetensors (sharded, HF-compatible) and torch distributed checkpoints.

Each rank reads only the rows its shards cover and writes one tensor at a time. Nothing
here knows an engine: where a rank keeps a parameter comes in as `annot.meta.layout`
data from the engine that sharded it.
"""
