"""Flax adapters: `task(Module)`, `parallelize_step`, and `functional_step` for NNX steps that update in
place (Flax metadata is read by `core.metadata`)."""
