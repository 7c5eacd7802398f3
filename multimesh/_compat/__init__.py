"""The one place where multimesh reaches into its dependencies' private internals.

One module per dependency (`jax`, `orbax`, `flax`, `tqdm`; `clusters`: JAX's launcher detection);
every function says which public API would replace it and on which versions it is tested.
Everything else in multimesh, `trainers` and `models` uses public API only: it imports no private name and
touches no private attribute but its own (``tests/test_private_imports.py`` checks both). What the next
versions are known to change is in ``README.md`` beside this file.
"""
