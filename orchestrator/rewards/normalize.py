"""Normalising one reward's values before they are weighed (`rewards[].normalize`), so that a reward model's
arbitrary scale can be combined with other rewards by weight: `group` z-scores each value among its prompt's
samples (the per-group normalisation of GRPO's advantages, Shao et al. 2024, applied to one reward), `batch`
among the whole batch. Values a reward skipped (None) stay None and are left out of the statistics; a set of
values with no spread becomes zeros."""
from __future__ import annotations

import math
from collections.abc import Sequence

EPS = 1e-6


def normalized(values: Sequence[float | None], groups: Sequence[int], mode: str) -> list[float | None]:
    if mode == "none":
        return list(values)
    if mode not in ("group", "batch"):
        raise ValueError(f"unknown normalisation {mode!r}")
    keys = list(groups) if mode == "group" else [0] * len(values)
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} groups for {len(values)} values")
    members: dict[int, list[float]] = {}
    for key, v in zip(keys, values):
        if v is not None:
            members.setdefault(key, []).append(v)
    stats = {}
    for key, vs in members.items():
        mean = sum(vs) / len(vs)
        std = math.sqrt(sum((v - mean) ** 2 for v in vs) / len(vs))  # population std, as GRPO's
        stats[key] = (mean, std)
    out: list[float | None] = []
    for key, v in zip(keys, values):
        if v is None:
            out.append(None)
            continue
        mean, std = stats[key]
        out.append(0.0 if std < EPS else (v - mean) / std)
    return out
