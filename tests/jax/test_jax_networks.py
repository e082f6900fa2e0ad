"""The actor-critic's Dense product: same values and gradients as Flax's plain Dense, and a weight gradient that
XLA:CPU compiles as a product YNNPACK accepts (lhs contracting over its last dimension)."""
from __future__ import annotations

import re

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(120, method="thread")


def _plain_and_custom():
    import flax.linen as nn
    import jax.numpy as jnp

    from trainer.jax.networks import ActorCritic

    class PlainActorCritic(ActorCritic):
        """The same module with Flax's default product (the reference)."""

        @nn.compact
        def __call__(self, obs):
            act, ortho = nn.tanh, nn.initializers.orthogonal
            a = v = obs.astype(jnp.float32)
            for i, h in enumerate(self.hidden_sizes):
                a = act(nn.Dense(h, kernel_init=ortho(np.sqrt(2)), name=f"actor_{i}")(a))
                v = act(nn.Dense(h, kernel_init=ortho(np.sqrt(2)), name=f"critic_{i}")(v))
            logits = nn.Dense(self.action_dim, kernel_init=ortho(0.01), name="actor_out")(a)
            return logits, nn.Dense(1, kernel_init=ortho(1.0), name="critic_out")(v)[..., 0]

    class CustomActorCritic(ActorCritic):
        """tide's module (its Dense layers use dense_dot_general), returning logits instead of a distribution."""

        def __call__(self, obs):
            dist, value = super().__call__(obs)
            return dist.logits, value

    return PlainActorCritic(action_dim=2, discrete=True), CustomActorCritic(action_dim=2, discrete=True)


# A weight gradient sums 128 rows' products of order 1 in float32, in an order that differs between the two
# products (and between CPUs): its rounding reaches 128 x 6e-8 ~ 8e-6 for a near-zero entry, where rtol gives no
# room. Measured 1.8e-6 on an AMD EPYC (2026-11-27); a wrong contraction differs by the products themselves.
GRAD_ATOL = 1e-5


def test_dense_product_matches_flax_dense_values_and_gradients():
    import jax
    import jax.numpy as jnp

    plain, custom = _plain_and_custom()
    obs = jax.random.normal(jax.random.PRNGKey(1), (128, 4))
    params = plain.init(jax.random.PRNGKey(0), obs)
    assert jax.tree.structure(params) == jax.tree.structure(custom.init(jax.random.PRNGKey(0), obs))

    def loss(module, p, o):
        logits, value = module.apply(p, o)
        return jnp.sum(jnp.tanh(logits) * jnp.arange(1.0, 3.0)) + jnp.sum(value ** 2)

    for batch in (obs, obs.reshape(8, 16, 4)):  # rows, and extra leading axes (the rollout's [T, envs])
        np.testing.assert_allclose(custom.apply(params, batch)[0], plain.apply(params, batch)[0], rtol=1e-6, atol=1e-6)
        g_plain = jax.grad(lambda p: loss(plain, p, batch))(params)
        g_custom = jax.grad(lambda p: loss(custom, p, batch))(params)
        for a, b in zip(jax.tree.leaves(g_custom), jax.tree.leaves(g_plain)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=GRAD_ATOL)
    # vmapped over seeds, as the engine runs them
    stacked = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), params)
    g_plain = jax.vmap(jax.grad(lambda p: loss(plain, p, obs)))(stacked)
    g_custom = jax.vmap(jax.grad(lambda p: loss(custom, p, obs)))(stacked)
    for a, b in zip(jax.tree.leaves(g_custom), jax.tree.leaves(g_plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=GRAD_ATOL)


def test_weight_gradients_compile_to_products_contracting_the_lhs_last_dimension():
    """The point of the custom product: without it XLA:CPU writes each hidden layer's weight gradient as a dot
    with lhs_contracting_dims={0}, which YNNPACK declines (so it runs on Eigen)."""
    import jax
    import jax.numpy as jnp

    plain, custom = _plain_and_custom()
    obs = jnp.ones((128, 4))
    params = plain.init(jax.random.PRNGKey(0), obs)

    def lhs_row_contracting_dots(module) -> list[str]:
        grad = jax.jit(jax.grad(lambda p: jnp.sum(module.apply(p, obs)[0]) + jnp.sum(module.apply(p, obs)[1])))
        hlo = grad.lower(params).compile().as_text()
        return [line for line in hlo.splitlines()
                if re.search(r"\bdot\(", line) and "lhs_contracting_dims={0}" in line and "f32[1," not in line
                and not re.search(r"f32\[\d+,1\]", line.split("=")[1])]

    assert lhs_row_contracting_dots(plain), "the reference no longer shows the pattern this test guards against"
    assert lhs_row_contracting_dots(custom) == []
