"""What a reward function returned, checked on the driver: one finite number or None per completion, and
numeric logged metrics; anything else is refused naming the function."""
from __future__ import annotations

import math
from typing import Any

from orchestrator.rewards.errors import RewardFunctionError


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def validated(who: str, got: Any, n: int) -> list[float | None]:
    if not isinstance(got, list) or len(got) != n:
        size = len(got) if isinstance(got, list) else type(got).__name__
        raise RewardFunctionError(f"{who} returned {size} values for {n} completions")
    out: list[float | None] = []
    for i, v in enumerate(got):
        if v is None:
            out.append(None)
        elif is_number(v):
            out.append(float(v))
        else:
            hint = " (a veRL dict holds it as 'score')" if isinstance(v, dict) else ""
            raise RewardFunctionError(f"{who} returned {v!r} for completion {i}: "
                                      f"a finite number or None is required{hint}")
    return out


def metric_values(who: str, name: str, values: list) -> list[float]:
    bad = [v for v in values if not isinstance(v, (int, float))]
    if bad:
        raise RewardFunctionError(f"{who} logged metric {name!r} = {bad[0]!r}: a "
                                  f"number is required")
    return [float(v) for v in values]
