"""Float8 training and compiled blocks through `annot.auto_wrap`: 2 gloo ranks against one
process running the same float8 model, bitwise; compiled blocks against eager; states
saved with either resumed without it. Needs torchao (CI installs it after the main run)."""
