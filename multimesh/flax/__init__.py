"""Flax adapters: `task(Module)` and `parallelize_step` (Flax metadata is read by `core.metadata`)."""
