"""MPMD: tasks on submeshes, the plan that partitions a step, its schedule and its runtime."""

from .implicit import clear_tasks, register_task, registered_tasks, task_scope
from .microbatch import microbatch
from .plan import Plan, partition
from .runtime import RunStats, Runtime
from .schedules import GPipe, Interleaved1F1B, OneFOneB, Schedule, get_schedule
from .task import Placement, ignore_transforms, task

__all__ = [
           "GPipe",
           "Interleaved1F1B",
           "OneFOneB",
           "Placement",
           "Plan",
           "RunStats",
           "Runtime",
           "Schedule",
           "clear_tasks",
           "get_schedule",
           "ignore_transforms",
           "microbatch",
           "partition",
           "register_task",
           "registered_tasks",
           "task",
           "task_scope",
]
