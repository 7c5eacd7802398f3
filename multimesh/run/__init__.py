"""Execution: a step built on a given mesh (`parallelize.parallelize_on_mesh`, which the public
`multimesh.parallelize` calls), `mjit`, the sharded initializers, the SPMD step, the MPMD step and its runtime."""
