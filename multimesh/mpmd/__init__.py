"""MPMD: tasks on submeshes, the plan that partitions a step, and its runtime."""

from .plan import Plan, partition
from .runtime import Runtime
from .schedules import GPipe, Interleaved1F1B, OneFOneB, Schedule, get_schedule
from .task import Placement, ignore_transforms, task

__all__ = ["task", "ignore_transforms", "Placement", "Plan", "partition", "Runtime", "Schedule", "GPipe",
           "OneFOneB", "Interleaved1F1B", "get_schedule"]
