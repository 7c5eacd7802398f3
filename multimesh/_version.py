"""The package version (one place: `multimesh.__version__` and `multimesh.jax.__version__`)."""

__version__ = "0.1.0"
