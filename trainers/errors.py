"""The trainer's own error: a config that is invalid, or does not fit what it runs on.

Its own module so that the checks (``trainers.config``, ``trainers.fit``) can
share it without importing each other; ``trainers.config`` re-exports it.
"""

from __future__ import annotations

__all__ = ["ConfigError", "ConfigWarning"]


class ConfigError(ValueError):
    """A config problem; the message names the key (e.g. ``optimizer.lr``), its value and the fix.

    ``multimesh-train`` prints it as one line and exits with status 2.
    """


class ConfigWarning(UserWarning):
    """A config that runs but probably not as meant (e.g. a mesh axis no rule uses); the message names the key."""
