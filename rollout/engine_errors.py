"""What a rollout engine raises to its caller (the rollout group, through Ray)."""
from __future__ import annotations


class EngineError(RuntimeError):
    """The engine could not serve a call (it kept dying, or failed to start)."""


class SyncError(RuntimeError):
    """A sync was refused or failed; the engine still serves the previous verified weights."""
