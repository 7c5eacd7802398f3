"""MPMD: tasks on submeshes, the plan that partitions a step, its schedule and its runtime."""

from .implicit import clear_tasks, register_task, registered_tasks, task_scope
from .microbatch import microbatch
from .plan import Plan, partition
from .runtime import Runtime, RunStats
from .schedules import GPipe, Interleaved1F1B, OneFOneB, Schedule, get_schedule
from .task import Placement, ignore_transforms, task

__all__ = ["task", "microbatch", "register_task", "clear_tasks", "task_scope", "registered_tasks",
           "ignore_transforms", "Placement", "Plan", "partition", "Runtime", "RunStats", "Schedule", "GPipe",
           "OneFOneB", "Interleaved1F1B", "get_schedule"]
