"""The only place multimesh reads private JAX, Orbax or Flax internals; each module says which and why."""
