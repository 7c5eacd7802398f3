"""Starting the processes of a multi-process run, before and while JAX starts.

`launch` (a process's place from its arguments or its launcher's variables), `rollcall` (who has
come to the coordinator port, of which run id, before JAX starts), `gloo_notices` (gloo's connection
notices kept off stdout), `agreement` (the same values on every process) and `ports` (the cross-host
transfer port, held from its choice on). `multimesh.distributed`
is their public front.
"""
