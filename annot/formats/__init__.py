"""Checkpoint formats: the adapters that tell annot's generic loader and saver
(`annot.checkpoint_io`) how one library lays out its checkpoints.

Each adapter is a `annot.checkpoint_io.formats.CheckpointFormat`: transformers'
(`transformers`: renamed legacy keys, tensors its converters fuse on load), PEFT's
(`peft`: a base model's checkpoint loaded into a PEFT model, adapter and merged
exports), diffusers' (`diffusers`: file names, a pipeline's component folders, the
config written back). `choice` picks the one for a model and a path. The libraries are
imported inside functions; `annot.checkpoint_io` imports nothing from here
(docs/design.md, "The import check").
"""
