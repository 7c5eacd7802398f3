"""multimesh: model parallelism for JAX and Flax on stock JAX.

The public API lives in `multimesh.jax` (and `multimesh.jax.flax`); the same
names are re-exported here. The front door, `parallelize`, is defined in
`multimesh/parallelize.py`.
"""

import importlib

from ._version import __version__  # noqa: F401
from .jax import *  # noqa: F403 - the public API, re-exported (its __all__)
from .jax import __all__  # noqa: F401

# `estimate` names both the function and its package: the package, callable as the function (so that
# ``multimesh.estimate(step)`` and ``multimesh.estimate.calibrate()`` both work)
estimate = importlib.import_module(".estimate", __name__)  # type: ignore[assignment]  # the module, on purpose
