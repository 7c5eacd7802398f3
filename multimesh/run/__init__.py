"""Execution: the front door (`parallelize`), the SPMD step, the MPMD step and its runtime."""
