"""Flax MLPs: the actor-critic of PPO and IMPALA (separate actor and critic torsos, orthogonal init), and SAC's
tanh-squashed Gaussian actor and twin Q critics."""
from __future__ import annotations

import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from trainer.jax.distributions import Categorical, DiagNormal


@jax.custom_vjp
def _dense_product(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


def _dense_product_fwd(x: jax.Array, w: jax.Array):
    return _dense_product(x, w), (x, w)


def _dense_product_bwd(residuals, g: jax.Array):
    x, w = residuals
    dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())))
    # x^T materialised; the barrier keeps XLA from folding the transpose back into the product
    x_t = jax.lax.optimization_barrier(x.reshape(-1, x.shape[-1]).T)
    return dx, x_t @ g.reshape(-1, g.shape[-1])


_dense_product.defvjp(_dense_product_fwd, _dense_product_bwd)


def dense_dot_general(x: jax.Array, w: jax.Array, dimension_numbers, precision=None,
                      preferred_element_type=None) -> jax.Array:
    """`lax.dot_general` for a Dense layer (x [..., in] . w [in, out]) whose weight gradient XLA:CPU can run on
    YNNPACK. JAX's transpose rule writes that gradient as one product contracting x over its rows (lhs contracting
    dimension 0); XLA:CPU hands YNNPACK only products whose lhs contracts over its last dimension (xla/backends/
    cpu/ynn_support.cc, IsDotSupportedByYnn), so those went to Eigen dot thunks, the slowest steps of a PPO
    minibatch at 4 envs. Here x is transposed explicitly, behind an optimization barrier (else XLA folds the
    transpose back into the product). Same products, same values up to summation order. On other backends, and
    for any other contraction, plain `lax.dot_general`."""
    standard = dimension_numbers == (((x.ndim - 1,), (0,)), ((), ())) and w.ndim == 2
    if not standard or precision is not None or preferred_element_type is not None or jax.default_backend() != "cpu":
        return jax.lax.dot_general(x, w, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type)
    return _dense_product(x, w)


def _activation(name: str):
    return nn.tanh if name == "tanh" else nn.relu


class ActorCritic(nn.Module):
    action_dim: int
    discrete: bool
    hidden_sizes: Sequence[int] = (64, 64)
    activation: str = "tanh"
    obs_rank: int = 1  # trailing observation dims flattened into the MLP input (3 for MinAtar images)

    def flatten(self, obs: jax.Array) -> jax.Array:
        return obs.reshape(obs.shape[: obs.ndim - self.obs_rank] + (-1,)).astype(jnp.float32)

    @nn.compact
    def __call__(self, obs: jax.Array) -> tuple[Categorical | DiagNormal, jax.Array]:
        act = _activation(self.activation)
        a = v = self.flatten(obs)
        ortho = nn.initializers.orthogonal
        dense = functools.partial(nn.Dense, dot_general=dense_dot_general)
        for i, h in enumerate(self.hidden_sizes):
            a = act(dense(h, kernel_init=ortho(np.sqrt(2)), name=f"actor_{i}")(a))
            v = act(dense(h, kernel_init=ortho(np.sqrt(2)), name=f"critic_{i}")(v))
        out = dense(self.action_dim, kernel_init=ortho(0.01), name="actor_out")(a)
        value = nn.Dense(1, kernel_init=ortho(1.0), name="critic_out")(v)[..., 0]  # one column: never YNNPACK
        if self.discrete:
            return Categorical(out), value
        return DiagNormal(out, self.param("log_std", nn.initializers.zeros, (self.action_dim,))), value


class Flat:
    """A Flax module whose parameters live as one flat vector: an optimizer (norm clipping, Adam), Polyak averaging
    or a shard mean is then a handful of ops per step instead of a handful per parameter leaf. `dummy_inputs`:
    one unbatched example of the module's inputs (shapes and dtypes only)."""

    def __init__(self, module: nn.Module, *dummy_inputs: jax.Array) -> None:
        self.module = module
        self._dummy = dummy_inputs
        shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), *dummy_inputs)
        _, self.unravel = ravel_pytree(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes))
        # Initialised outside any vmap: orthogonal init (a batched LAPACK QR) inside a vmapped jit can deadlock
        # jaxlib's CPU thread pool (FEASIBILITY, JAX).
        self._init = jax.jit(module.init)

    def init(self, key: jax.Array) -> jax.Array:
        return ravel_pytree(self._init(key, *self._dummy))[0]

    def apply(self, flat: jax.Array, *inputs: jax.Array):
        return self.module.apply(self.unravel(flat), *inputs)

    def seed_tree(self, params: jax.Array, seed: int = 0) -> Any:
        """One seed's parameters as the Flax variable tree, from an engine state's [seeds, shards, n] vectors
        (shard 0: all shards hold the same)."""
        return self.unravel(jnp.asarray(jax.device_get(params)[seed, 0]))


def _mlp(x: jax.Array, hidden_sizes: Sequence[int], activation: str, prefix: str) -> jax.Array:
    act = _activation(activation)
    for i, h in enumerate(hidden_sizes):
        x = act(nn.Dense(h, name=f"{prefix}_{i}")(x))
    return x


class SquashedGaussianActor(nn.Module):
    """SAC's policy: a Gaussian over pre-squash actions u, the action a = tanh(u) in [-1, 1]^d (the engine scales
    it to the env's bounds); log_std clipped to [log_std_min, log_std_max] (Haarnoja et al. 2018, appendix C)."""

    action_dim: int
    hidden_sizes: Sequence[int] = (256, 256)
    activation: str = "relu"
    log_std_min: float = -5.0
    log_std_max: float = 2.0

    @nn.compact
    def __call__(self, obs: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = _mlp(obs.astype(jnp.float32), self.hidden_sizes, self.activation, "actor")
        mean = nn.Dense(self.action_dim, name="mean")(x)
        log_std = jnp.clip(nn.Dense(self.action_dim, name="log_std")(x), self.log_std_min, self.log_std_max)
        return mean, log_std


class TwinQ(nn.Module):
    """Two independent Q(s, a) MLPs (clipped double Q: Fujimoto et al. 2018, used by SAC); returns [2, ...]."""

    hidden_sizes: Sequence[int] = (256, 256)
    activation: str = "relu"

    @nn.compact
    def __call__(self, obs: jax.Array, action: jax.Array) -> jax.Array:
        x = jnp.concatenate([obs.astype(jnp.float32), action], axis=-1)
        qs = [nn.Dense(1, name=f"q{i}_out")(_mlp(x, self.hidden_sizes, self.activation, f"q{i}"))[..., 0]
              for i in range(2)]
        return jnp.stack(qs)
