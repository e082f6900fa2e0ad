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
the default lowering is used.

`compile(jitted, *args, cpu_matmul=...)` lowers so and compiles; on CPU, `cpu_matmul` picks the library XLA
runs the matrix products with: "ynnpack" (XLA:CPU's default in jax 0.10) or "eigen" (XLA's own dots). They
split products over the cores from different sizes: on 2 cores YNNPACK keeps a [256, 128] x [128, 128] product
on one core (~95 GFLOP/s) where Eigen uses both (~140), while YNNPACK is ahead at small products and 256-wide
layers (docs/design.md has the table). A per-compile option: nothing else in the process changes."""
from __future__ import annotations

from typing import Any

import jax


def _overrides() -> Any:
    try:
        from jax._src.interpreters import mlir
        from jax._src.random import threefry2x32 as threefry

        rule = threefry._threefry2x32_lowering_rule  # noqa: SLF001  (what JAX registers for non-CPU platforms)
        return mlir.LoweringParameters(override_lowering_rules=((threefry.threefry2x32_p, rule),))
    except (ImportError, AttributeError, TypeError):
        return None


def compiler_options(cpu_matmul: str) -> dict[str, Any]:
    """XLA compile options for a CPU program whose matrix products run on `cpu_matmul` ("ynnpack" | "eigen")."""
    if cpu_matmul == "eigen":
        return {"xla_cpu_experimental_ynn_fusion_type": ""}  # no YNNPACK fusions: dots stay XLA's (Eigen)
    if cpu_matmul == "ynnpack":
        return {}
    raise ValueError(f"cpu_matmul must be ynnpack or eigen, not {cpu_matmul!r}")


def lower(jitted: Any, *args: Any) -> Any:
    """`jitted.lower(*args)`, with jax.random's threefry unrolled."""
    parameters = _overrides()
    if parameters is None:
        return jitted.lower(*args)
    return jitted.trace(*args).lower(_private_parameters=parameters)


def compile(jitted: Any, *args: Any, cpu_matmul: str = "ynnpack") -> Any:  # noqa: A001  (the stage it names)
    """`lower(jitted, *args).compile()`, with `compiler_options(cpu_matmul)` when JAX's backend is the CPU."""
    options = compiler_options(cpu_matmul)
    return lower(jitted, *args).compile(compiler_options=options if jax.default_backend() == "cpu" else None)
