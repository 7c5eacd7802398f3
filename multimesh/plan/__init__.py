"""The MPMD plan: a traced step cut into segments on submeshes, ordered by a schedule, grouped into programs."""
