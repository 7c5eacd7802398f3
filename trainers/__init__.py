"""The example trainer: ``python -m trainers`` / ``multimesh-train`` (see README, "Training").

Modules: ``config`` (YAML configs, inheritance, overrides, validation),
``fit`` (whether a config fits its batch, data, devices and out_dir),
``errors`` (``ConfigError``, ``ConfigWarning``), ``mesh_axes`` (a mesh axis the standard rules leave
unused, warned about), ``layout`` (SPMD mesh + rules, or an MPMD pipeline), ``optim`` (AdamW and its
schedule), ``step`` (the train/eval steps, parallelized), ``feed`` (batches as
the steps' input, per process), ``train`` (the loop, checkpoints, resume),
``metrics`` (JSONL, throughput, loss plot), ``nonfinite`` (NaN/inf found
and stopped at), ``preemption`` (SIGTERM/SIGINT: checkpoint the step, then
stop), ``sample`` (text from a checkpoint), ``data`` (the byte-level corpus),
``cli``.
"""
