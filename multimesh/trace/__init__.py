"""What runs while a step is traced: sharding constraints, tasks, implicit tasks, microbatching."""
