"""transformers and PEFT models: recognising them, the one choice of model class for a
directory or config, training adjustments, and `annot.from_pretrained`.

transformers is imported inside the functions that need it: ``import annot`` stays light.
"""
