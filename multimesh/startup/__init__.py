"""Starting the processes of a multi-process run, before and while JAX starts.

`launch` (a process's place from its arguments or its launcher's variables), `rollcall` (who has
come to the coordinator port, of which run id, before JAX starts), `gloo_notices` (gloo's connection
notices kept off stdout) and `agreement` (the same values on every process). `multimesh.distributed`
is their public front.
"""
