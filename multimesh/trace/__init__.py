"""What runs while a step is traced: sharding constraints, tasks, implicit tasks, microbatching."""

from . import linen_constraints  # noqa: F401  (routes Flax Linen's logical constraints while a placement is in force)
