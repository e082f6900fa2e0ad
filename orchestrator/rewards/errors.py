"""The reward room's errors."""


class RewardFunctionError(RuntimeError):
    """A reward function that cannot be loaded, raised, hung, or returned something other than one number or None
    per completion; the message names it, `user_traceback` holds the traceback of the function's own raise (in the
    worker process) when there was one."""

    user_traceback: str | None = None


class ServedModelError(RuntimeError):
    """A served model (`models:`, orchestrator/workers/served_models.py) that cannot start or answer; the message
    names it."""
