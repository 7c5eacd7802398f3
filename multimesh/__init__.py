"""multimesh: model parallelism for JAX and Flax on stock JAX.

The public API lives in `multimesh.jax` (and `multimesh.jax.flax`); the same
names are re-exported here.
"""

from .jax import *  # noqa: F401,F403
from .jax import __all__  # noqa: F401

__version__ = "0.1.0"
