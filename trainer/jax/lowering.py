"""How the engine's programs are lowered for XLA:CPU.

JAX lowers the threefry2x32 hash (every `jax.random` draw) on CPU as a rolled loop of 5 trips, to keep compile
times short; for other platforms it lowers the same rounds unrolled. XLA:CPU runs the rolled loop as a while
loop of ~30 tiny thunks (copies of the loop state, the trip compare, the round fusions), and inside a rollout or
gradient-step loop that overhead is paid at every step (profiled at 8 seeds x 4 envs on CartPole, one CPU
device: the rollout's per-step reset draws took longer than its policy network). The unrolled form is the same
arithmetic, so the same bits, in one fusion.

`lower(jitted, *args)` lowers a jitted function with JAX's unrolled threefry rule in place of its CPU rule, for
that lowering only (JAX's per-lowering rule override; nothing else in the process changes: rejax in the
benchmark keeps JAX's default). The override is a private JAX parameter (jax is pinned); where it is missing,
the default lowering is used."""
from __future__ import annotations

from typing import Any


def _overrides() -> Any:
    try:
        from jax._src.interpreters import mlir
        from jax._src.random import threefry2x32 as threefry

        rule = threefry._threefry2x32_lowering_rule  # noqa: SLF001  (what JAX registers for non-CPU platforms)
        return mlir.LoweringParameters(override_lowering_rules=((threefry.threefry2x32_p, rule),))
    except (ImportError, AttributeError, TypeError):
        return None


def lower(jitted: Any, *args: Any) -> Any:
    """`jitted.lower(*args)`, with jax.random's threefry unrolled."""
    parameters = _overrides()
    if parameters is None:
        return jitted.lower(*args)
    return jitted.trace(*args).lower(_private_parameters=parameters)
