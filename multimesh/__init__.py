"""multimesh: model parallelism for JAX and Flax on stock JAX.

The public API lives in `multimesh.jax` (and `multimesh.jax.flax`); the same
names are re-exported here.
"""

from ._version import __version__  # noqa: F401
from .jax import *
from .jax import __all__  # noqa: F401
