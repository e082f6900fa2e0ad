"""Benchmark of the JAX engine (docs/benchmarks.md): PPO env steps per second on CartPole-v1 against rejax
(same env, num_envs, rollout length and PPO settings) and a CleanRL-style Python-loop PyTorch PPO on
gymnasium's CartPole-v1; and wall seconds until the mean episode return reaches 475.

Throughput: each contender/baseline runs a compiled chunk of PPO updates (rollout + 4 epochs x 4
minibatches), alternating A B A B (tide with rejax; at 4 envs tide with the PyTorch loop in a second
alternation); compile time is excluded (measured separately). rejax runs its own
`train_iteration` in the same fori_loop chunking, without its evaluation callback. The process has one
XLA CPU device per core (`use_cpu_cores`, as `tide run` does): single-seed rows run every contender on
one device; 8 vmapped seeds run tide and rejax on one device each (the goal), and tide over all devices
beside them (the seeds never communicate).
Solve time: compile included; fixed seeds 0, 1, 2 per side (quick mode too); a run that does not reach the
target within the cap counts as infinitely long on either side; tide and rejax are both checked after every
chunk of 25 updates with
rejax's `evaluate` (128 episodes of the stochastic policy, not counted in the time), PyTorch by the mean
of its last 20 training episodes; all three with the num_envs, rollout length and learning rate of
configs/cartpole.yaml (rejax without LR annealing, which it lacks).

    python scripts/bench_jax.py [--quick]      writes bench_results/jax.json
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Report, bench_arguments, repeats_for  # noqa: E402

from trainer.jax.lowering import compiler_options  # noqa: E402

NUM_STEPS = 128
PPO = dict(epochs=4, minibatches=4, lr=2.5e-4, gamma=0.99, gae_lambda=0.95, clip_eps=0.2, ent_coef=0.01,
           vf_coef=0.5, max_grad_norm=0.5, hidden=(64, 64))
TARGET = 475.0


# ---------------------------------------------------------------- contender: tide's JAX engine
def tide_engine(num_envs: int, updates: int, seeds: int = 1, total_updates: int = 10_000, devices: int | None = 1,
                cpu_matmul: str = "ynnpack"):
    """devices=None: as `tide run` lays seeds out, over every host CPU device that divides them."""
    from trainer.jax.config import JaxConfig
    from trainer.jax.engine import Engine

    cfg = JaxConfig(env="CartPole-v1", num_envs=num_envs, num_steps=NUM_STEPS, updates_per_iteration=updates,
                    epochs=PPO["epochs"], minibatches=PPO["minibatches"], lr=PPO["lr"], seeds=seeds,
                    hidden_sizes=list(PPO["hidden"]), cpu_matmul=cpu_matmul)
    return chunk_step(Engine(cfg, total_updates=total_updates, seed=0, devices=devices))


def chunk_step(engine):
    """A call that runs one compiled chunk of the engine's updates (compiled here, not in the call)."""
    import jax

    state = engine.init_state()
    engine.compile(state)
    box = {"state": state}

    def step() -> None:
        box["state"], _ = engine.run_chunk(box["state"])
        jax.block_until_ready(box["state"])

    return step


# ---------------------------------------------------------------- baseline: rejax
def _rejax_algo(num_envs: int, num_steps: int = NUM_STEPS, lr: float = PPO["lr"]):
    from gymnax.environments.classic_control.cartpole import CartPole
    from rejax import PPO as RejaxPPO

    env = _five_value_step(CartPole)()
    return RejaxPPO.create(
        env=env, env_params=env.default_params, num_envs=num_envs, num_steps=num_steps,
        num_epochs=PPO["epochs"], num_minibatches=PPO["minibatches"], learning_rate=lr,
        gamma=PPO["gamma"], gae_lambda=PPO["gae_lambda"], clip_eps=PPO["clip_eps"], ent_coef=PPO["ent_coef"],
        vf_coef=PPO["vf_coef"], max_grad_norm=PPO["max_grad_norm"],
        agent_kwargs={"activation": "tanh", "hidden_layer_sizes": PPO["hidden"]}, skip_initial_evaluation=True)


def _five_value_step(env_cls):
    """rejax 0.1.3 unpacks gymnax's step as 5 values; gymnax 1.0 returns 6 (FEASIBILITY, JAX)."""
    import jax.numpy as jnp

    class FiveValueStep(env_cls):
        def step(self, key, state, action, params=None):
            obs, state, reward, terminated, truncated, info = super().step(key, state, action, params)
            return obs, state, reward, jnp.logical_or(terminated, truncated), info

    return FiveValueStep


def rejax_step(num_envs: int, updates: int, seeds: int = 1):
    import jax

    algo = _rejax_algo(num_envs)

    def chunk(ts):
        return jax.lax.fori_loop(0, updates, lambda _, t: algo.train_iteration(t), ts)

    if seeds == 1:
        ts = algo.init_state(jax.random.PRNGKey(0))
        fn = jax.jit(chunk, donate_argnums=0)
    else:
        ts = jax.vmap(algo.init_state)(jax.random.split(jax.random.PRNGKey(0), seeds))
        fn = jax.jit(jax.vmap(chunk), donate_argnums=0)
    compiled = fn.lower(ts).compile()
    box = {"ts": ts}

    def step() -> None:
        box["ts"] = jax.block_until_ready(compiled(box["ts"]))

    return step


# ---------------------------------------------------------------- baseline: Python-loop PyTorch PPO
class TorchPPO:
    """CleanRL-style PPO: gymnasium SyncVectorEnv, PyTorch actor and critic MLPs, one env step per
    Python iteration."""

    def __init__(self, num_envs: int = 4, seed: int = 0, total_updates: int = 1000, num_steps: int = NUM_STEPS,
                 lr: float = PPO["lr"]) -> None:
        import gymnasium as gym
        import numpy as np
        import torch
        from torch import nn

        torch.set_num_threads(1)  # fastest setting for these tiny networks on this machine
        torch.manual_seed(seed)
        self.torch, self.np, self.n = torch, np, num_envs
        self.envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(num_envs)])
        self.envs = gym.wrappers.vector.RecordEpisodeStatistics(self.envs)
        obs_dim, n_act = self.envs.single_observation_space.shape[0], self.envs.single_action_space.n

        def mlp(out: int, std: float) -> nn.Module:
            layers, d = [], obs_dim
            for h in PPO["hidden"]:
                lin = nn.Linear(d, h)
                nn.init.orthogonal_(lin.weight, 2**0.5)
                nn.init.zeros_(lin.bias)
                layers += [lin, nn.Tanh()]
                d = h
            last = nn.Linear(d, out)
            nn.init.orthogonal_(last.weight, std)
            nn.init.zeros_(last.bias)
            return nn.Sequential(*layers, last)

        self.actor, self.critic = mlp(n_act, 0.01), mlp(1, 1.0)
        params = list(self.actor.parameters()) + list(self.critic.parameters())
        self.lr, self.T = lr, num_steps
        self.opt = torch.optim.Adam(params, lr=lr, eps=1e-5)
        self.params, self.total_updates, self.updates = params, total_updates, 0
        obs, _ = self.envs.reset(seed=seed)
        self.obs = torch.tensor(obs, dtype=torch.float32)
        self.returns: list[float] = []

    def update(self) -> None:
        torch, T, n = self.torch, self.T, self.n
        obs_b = torch.zeros(T, n, self.obs.shape[1])
        act_b, logp_b, rew_b, done_b, val_b = (torch.zeros(T, n) for _ in range(5))
        with torch.no_grad():
            for t in range(T):
                logits = self.actor(self.obs)
                dist = torch.distributions.Categorical(logits=logits)
                action = dist.sample()
                obs_b[t], act_b[t], logp_b[t] = self.obs, action, dist.log_prob(action)
                val_b[t] = self.critic(self.obs)[:, 0]
                obs, reward, term, trunc, info = self.envs.step(action.numpy())
                done = self.np.logical_or(term, trunc)
                rew_b[t], done_b[t] = torch.tensor(reward), torch.tensor(done, dtype=torch.float32)
                if "episode" in info:
                    self.returns += [float(r) for r, m in zip(info["episode"]["r"], info["_episode"]) if m]
                self.obs = torch.tensor(obs, dtype=torch.float32)
            next_v = self.critic(self.obs)[:, 0]
            adv = torch.zeros(T, n)
            last = torch.zeros(n)
            for t in reversed(range(T)):
                live = 1.0 - done_b[t]
                nv = next_v if t == T - 1 else val_b[t + 1]
                delta = rew_b[t] + PPO["gamma"] * nv * live - val_b[t]
                last = delta + PPO["gamma"] * PPO["gae_lambda"] * live * last
                adv[t] = last
            ret = adv + val_b
        frac = 1.0 - self.updates / self.total_updates
        for g in self.opt.param_groups:
            g["lr"] = frac * self.lr
        b = [x.reshape((T * n,) + x.shape[2:]) for x in (obs_b, act_b, logp_b, adv, ret, val_b)]
        mb = T * n // PPO["minibatches"]
        eps = PPO["clip_eps"]
        for _ in range(PPO["epochs"]):
            perm = torch.randperm(T * n)
            for i in range(PPO["minibatches"]):
                o, a, lp, ad, rt, v = (x[perm[i * mb:(i + 1) * mb]] for x in b)
                ad = (ad - ad.mean()) / (ad.std() + 1e-8)
                dist = torch.distributions.Categorical(logits=self.actor(o))
                new_lp = dist.log_prob(a)
                ratio = (new_lp - lp).exp()
                pg = -torch.min(ratio * ad, ratio.clamp(1 - eps, 1 + eps) * ad).mean()
                nv = self.critic(o)[:, 0]
                vc = v + (nv - v).clamp(-eps, eps)
                vl = 0.5 * torch.max((nv - rt) ** 2, (vc - rt) ** 2).mean()
                loss = pg + PPO["vf_coef"] * vl - PPO["ent_coef"] * dist.entropy().mean()
                self.opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.params, PPO["max_grad_norm"])
                self.opt.step()
        self.updates += 1


def torch_step(updates: int):
    ppo = TorchPPO()

    def step() -> None:
        for _ in range(updates):
            ppo.update()

    return step


# ---------------------------------------------------------------- time to solve
def solve_tide(max_seconds: float, seed: int) -> float | None:
    import jax
    import yaml
    from rejax.evaluate import evaluate

    from trainer.jax.config import JaxConfig
    from trainer.jax.engine import Engine

    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs/cartpole.yaml").read_text())
    cfg = JaxConfig(**{**raw["jax"], "compilation_cache_dir": None})
    rejax_env = _rejax_algo(4)
    t0 = time.perf_counter()
    engine = Engine(cfg, total_updates=raw["iterations"] * cfg.updates_per_iteration, seed=seed, devices=1)
    state = engine.init_state()
    engine.compile(state)

    @jax.jit
    def eval_fn(params, rng):
        def act(obs, key):
            dist, _ = engine.algorithm.agent.module.apply(params, obs)
            return dist.sample(key)

        return evaluate(act, rng, rejax_env.env, rejax_env.env_params, 128,
                        rejax_env.env_params.max_steps_in_episode)

    def chunk(state):
        state, _ = engine.run_chunk(state)
        return jax.block_until_ready(state)

    return _seconds_to_target(t0, state, chunk, lambda st, i: eval_fn(engine.params_tree(st), jax.random.PRNGKey(i)),
                              raw["iterations"], max_seconds)


def _seconds_to_target(t0: float, state, chunk, evaluate, chunks: int, max_seconds: float) -> float | None:
    """Run training chunks until the evaluated mean return reaches TARGET; evaluation time is excluded."""
    excluded = 0.0
    for i in range(chunks):
        state = chunk(state)
        e0 = time.perf_counter()
        _, returns = evaluate(state, i)
        mean = float(returns.mean())
        excluded += time.perf_counter() - e0
        if mean >= TARGET:
            return time.perf_counter() - t0 - excluded
        if time.perf_counter() - t0 - excluded > max_seconds:
            break
    return None


def solve_rejax(max_seconds: float, seed: int) -> float | None:
    """rejax with the env count, rollout length, learning rate (constant: rejax has no annealing) and
    chunking of configs/cartpole.yaml."""
    import jax
    import yaml
    from rejax.evaluate import evaluate

    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs/cartpole.yaml").read_text())
    j = raw["jax"]
    chunk, total_updates = j["updates_per_iteration"], raw["iterations"] * j["updates_per_iteration"]
    algo = _rejax_algo(j["num_envs"], j["num_steps"], float(j["lr"]))
    t0 = time.perf_counter()
    ts = algo.init_state(jax.random.PRNGKey(seed))
    fn = jax.jit(lambda ts: jax.lax.fori_loop(0, chunk, lambda _, t: algo.train_iteration(t), ts)).lower(ts).compile()
    eval_fn = jax.jit(lambda ts, rng: evaluate(algo.make_act(ts), rng, algo.env, algo.env_params, 128,
                                               algo.env_params.max_steps_in_episode))
    return _seconds_to_target(t0, ts, lambda t: jax.block_until_ready(fn(t)),
                              lambda t, i: eval_fn(t, jax.random.PRNGKey(i)), total_updates // chunk, max_seconds)


def solve_torch(max_seconds: float, seed: int) -> float | None:
    """The Python-loop PPO with the settings of configs/cartpole.yaml (annealed like tide)."""
    import yaml

    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs/cartpole.yaml").read_text())
    j = raw["jax"]
    total = raw["iterations"] * j["updates_per_iteration"]
    t0 = time.perf_counter()
    ppo = TorchPPO(j["num_envs"], seed=seed, total_updates=total, num_steps=j["num_steps"],
                   lr=float(j["lr"]))
    while ppo.updates < total and time.perf_counter() - t0 < max_seconds:
        ppo.update()
        if len(ppo.returns) >= 20 and statistics.fmean(ppo.returns[-20:]) >= TARGET:
            return time.perf_counter() - t0
    return None


# ---------------------------------------------------------------- SAC: tide vs rejax on Pendulum-v1
# Equal work per update on both sides: num_envs env steps, then SAC_GRADIENT_STEPS gradient steps on batches of
# 256 (rejax's train_iteration; tide with num_steps 1), twin critics, Polyak 0.995, 128x128 ReLU MLPs, updates
# from 256 env steps on (the first, untimed call passes that point on both sides).
SAC = dict(hidden=(128, 128), batch_size=256, learning_starts=256, lr=1e-3, gamma=0.99, tau=0.005)
SAC_GRADIENT_STEPS = 1
# tide's SAC runs its products on Eigen, as configs/pendulum_sac.yaml sets (jax.cpu_matmul): at these sizes it
# splits them over both cores where YNNPACK, XLA's default and what rejax gets, keeps them on one. The row
# `sac_pendulum_num_envs_{n}_vs_rejax_on_eigen_dots` shows rejax with the same choice.
TIDE_SAC_CPU_MATMUL = "eigen"


def tide_sac_step(num_envs: int, updates: int, cpu_matmul: str = TIDE_SAC_CPU_MATMUL):
    from trainer.jax.config import JaxConfig
    from trainer.jax.engine import Engine

    cfg = JaxConfig(algorithm="sac", env="Pendulum-v1", num_envs=num_envs, num_steps=1, updates_per_iteration=updates,
                    lr=SAC["lr"], gamma=SAC["gamma"], hidden_sizes=list(SAC["hidden"]), activation="relu",
                    cpu_matmul=cpu_matmul,
                    sac=dict(buffer_size=100_000, batch_size=SAC["batch_size"], learning_starts=SAC["learning_starts"],
                             gradient_steps=SAC_GRADIENT_STEPS, tau=SAC["tau"]))
    return chunk_step(Engine(cfg, total_updates=10_000, seed=0, devices=1))


def rejax_sac_step(num_envs: int, updates: int, cpu_matmul: str = "ynnpack"):
    """rejax's SAC as its users run it (XLA's default products: YNNPACK), or with `cpu_matmul` "eigen", the
    library tide's SAC picks (an informational row: how much of the gap is that choice)."""
    import jax
    import jax.numpy as jnp
    from gymnax.environments.classic_control.pendulum import Pendulum
    from rejax import SAC as RejaxSAC

    env = _five_value_step(Pendulum)()
    algo = RejaxSAC.create(env=env, env_params=env.default_params, num_envs=num_envs, buffer_size=100_000,
                           fill_buffer=SAC["learning_starts"], batch_size=SAC["batch_size"], learning_rate=SAC["lr"],
                           num_epochs=SAC_GRADIENT_STEPS, gamma=SAC["gamma"], polyak=1.0 - SAC["tau"],
                           hidden_layer_sizes=SAC["hidden"], agent_kwargs={"activation": "relu"},
                           skip_initial_evaluation=True)
    # rejax's target critic starts as the same arrays as the critic: copies, so the state can be donated
    ts = jax.tree.map(jnp.copy, algo.init_state(jax.random.PRNGKey(0)))
    # Equal networks on both sides, checked: rejax's SAC reads `hidden_layer_sizes` from its top-level config
    # and overwrites one given in agent_kwargs with its default (64, 64)
    _, tide_state = _tide_sac_update(num_envs)
    sizes = {side: (sum(x.size for x in jax.tree.leaves(a)), sum(x.size for x in jax.tree.leaves(c))) for side, a, c in
             (("tide", tide_state.params.actor, tide_state.params.critic),
              ("rejax", ts.actor_ts.params, ts.critic_ts.params))}
    if sizes["tide"] != sizes["rejax"]:
        raise RuntimeError(f"SAC networks differ, (actor, critic) parameters: {sizes}")
    fn = jax.jit(lambda ts: jax.lax.fori_loop(0, updates, lambda _, t: algo.train_iteration(t), ts), donate_argnums=0)
    compiled = fn.lower(ts).compile(compiler_options=compiler_options(cpu_matmul))
    box = {"ts": ts}

    def step() -> None:
        box["ts"] = jax.block_until_ready(compiled(box["ts"]))

    return step


def _tide_sac_update(num_envs: int):
    """tide's SAC update with the bench's settings (one shard, one seed, past learning_starts) and its state."""
    import jax

    from trainer.jax.algorithm import make_algorithm
    from trainer.jax.config import JaxConfig
    from trainer.jax.envs import make_env

    cfg = JaxConfig(algorithm="sac", env="Pendulum-v1", num_envs=num_envs, num_steps=1, lr=SAC["lr"],
                    hidden_sizes=list(SAC["hidden"]), activation="relu", cpu_matmul=TIDE_SAC_CPU_MATMUL,
                    sac=dict(batch_size=SAC["batch_size"], learning_starts=0, gradient_steps=SAC_GRADIENT_STEPS))
    algo = make_algorithm(cfg, make_env("Pendulum-v1"), 1)
    return algo.make_update(()), jax.tree.map(lambda x: x[0], algo.init_seed(jax.random.PRNGKey(0)))


def sac_update_flops(num_envs: int) -> float:
    """XLA's FLOP count of one tide SAC update with the bench's settings (one shard, one seed)."""
    import jax

    update, state = _tide_sac_update(num_envs)
    cost = jax.jit(update).lower(state).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"])


# ---------------------------------------------------------------- IMPALA vs PPO (both tide) on CartPole-v1
IMPALA_VS_PPO = dict(env="CartPole-v1", num_envs=16, num_steps=32, updates_per_iteration=50, lr=1e-3)


def impala_or_ppo_engine(algorithm: str, seed: int = 0, total_updates: int = 10_000):
    from trainer.jax.config import JaxConfig
    from trainer.jax.engine import Engine

    extra = {"impala": {"lag": 1, "minibatches": 4}} if algorithm == "impala" else {}
    cfg = JaxConfig(algorithm=algorithm, **IMPALA_VS_PPO, compilation_cache_dir=None, **extra)
    return Engine(cfg, total_updates=total_updates, seed=seed, devices=1)


def impala_or_ppo_solve(algorithm: str, seed: int, chunks: int = 40) -> tuple[float | None, int | None]:
    """(wall seconds, env steps) until a chunk's mean training return reaches 475; compile included."""
    from trainer.jax.engine import summarize

    t0 = time.perf_counter()
    engine = impala_or_ppo_engine(algorithm, seed, total_updates=chunks * IMPALA_VS_PPO["updates_per_iteration"])
    state = engine.init_state()
    for i in range(chunks):
        state, metrics = engine.run_chunk(state)
        ret = summarize(metrics)["episode_return_mean"]
        if ret is not None and ret >= TARGET:
            return time.perf_counter() - t0, (i + 1) * engine.steps_per_chunk
    return None, None


# ---------------------------------------------------------------- harness
def measure(fns: dict[str, tuple], repeats: int) -> dict[str, dict[str, list[float]]]:
    """fns: name -> (step, env steps per call). Alternates; returns wall and CPU throughput samples."""
    out = {k: {"wall": [], "cpu": []} for k in fns}
    for k, (step, _) in fns.items():  # warm-up call each (first execution allocates)
        step()
    for _ in range(repeats):
        for k, (step, steps) in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            step()
            out[k]["wall"].append(steps / (time.perf_counter() - w0))
            out[k]["cpu"].append(steps / max(time.process_time() - c0, 1e-9))
    return out


def updates_for(num_envs: int, target_steps: int) -> int:
    return max(1, target_steps // (num_envs * NUM_STEPS))


def main() -> None:
    args = bench_arguments(__doc__).parse_args()
    quick = args.quick
    report = Report("jax", quick)

    import jax

    from trainer.jax.engine import enable_compilation_cache, use_cpu_cores

    use_cpu_cores()  # one XLA CPU device per core, as `tide run` sets up; single-seed rows still use one
    cache = Path(".cache/jax")
    cached = sum(1 for _ in cache.iterdir()) if cache.is_dir() else 0
    report.note("compilation_cache", {"dir": str(cache), "entries_at_start": cached, "warm": cached > 0,
                                      "what": "XLA's persistent compilation cache, used by every side; compile "
                                              "times (in the solve rows) are shorter when it was warm"})
    enable_compilation_cache(str(cache))
    env_counts = [4, 2048] if quick else [4, 16, 64, 256, 1024, 2048]
    repeats = repeats_for(quick)
    chunk_steps = 16_384 if quick else 65_536

    for n in env_counts:
        u = updates_for(n, chunk_steps)
        steps = n * NUM_STEPS * u
        tide = tide_engine(n, u)
        s = measure({"tide": (tide, steps), "rejax": (rejax_step(n, u), steps)}, repeats)
        if n == 4:
            # The Python loop gets its own alternation with tide: between the JAX programs it slowed both of
            # them down (tide 151k vs 176k, rejax 127k vs 143k steps/s, one probe) and widened the goal's spread.
            tu = max(1, u // 16)
            s_torch = measure({"tide": (tide, steps), "torch": (torch_step(tu), n * NUM_STEPS * tu)}, repeats)
        r = report.add(f"cartpole_num_envs_{n}", "tide", "rejax", "env_steps_per_s", s["tide"]["wall"],
                       s["rejax"]["wall"])
        report.add(f"cartpole_num_envs_{n}_cpu", "tide", "rejax", "env_steps_per_cpu_s", s["tide"]["cpu"],
                   s["rejax"]["cpu"])
        report.goal(f"steps_per_s_vs_rejax_num_envs_{n}", r["ratio"], 1.2, row=r)
        print(f"num_envs {n}: tide {r['contender_median']:.0f}/s rejax {r['baseline_median']:.0f}/s ratio {r['ratio']:.2f}",
              flush=True)
        if n == 4:
            rt = report.add("cartpole_num_envs_4_vs_python_loop", "tide", "torch_python_loop", "env_steps_per_s",
                            s_torch["tide"]["wall"], s_torch["torch"]["wall"])
            report.add("cartpole_num_envs_4_vs_python_loop_cpu", "tide", "torch_python_loop", "env_steps_per_cpu_s",
                       s_torch["tide"]["cpu"], s_torch["torch"]["cpu"])
            report.goal("steps_per_s_vs_python_loop_num_envs_4", rt["ratio"], 30.0, row=rt)
            print(f"  torch {rt['baseline_median']:.0f}/s ratio {rt['ratio']:.1f}", flush=True)

    # 8 seeds vmapped over the whole train state, 4 envs each, tide and rejax on one device each (the goal:
    # equal devices). tide laying the seeds out as `tide run` does (over the host CPU devices, one per core)
    # is measured beside the goal, in its own alternation with rejax.
    u = updates_for(4 * 8, chunk_steps)
    steps = 8 * 4 * NUM_STEPS * u
    rejax8 = rejax_step(4, u, seeds=8)
    s = measure({"tide_1_device": (tide_engine(4, u, seeds=8), steps), "rejax": (rejax8, steps)}, repeats)
    s_devices = measure({"tide": (tide_engine(4, u, seeds=8, devices=None), steps), "rejax": (rejax8, steps)},
                        repeats)
    n_dev = jax.device_count()
    report.machine_extra["jax_cpu_devices"] = n_dev
    r1 = report.add("cartpole_8_seeds_num_envs_4_one_device", "tide (1 device)", "rejax (1 device)",
                    "env_steps_per_s", s["tide_1_device"]["wall"], s["rejax"]["wall"])
    report.add("cartpole_8_seeds_num_envs_4_one_device_cpu", "tide (1 device)", "rejax (1 device)",
               "env_steps_per_cpu_s", s["tide_1_device"]["cpu"], s["rejax"]["cpu"])
    r = report.add("cartpole_8_seeds_num_envs_4", f"tide (seeds over {n_dev} CPU devices)", "rejax (1 device)",
                   "env_steps_per_s", s_devices["tide"]["wall"], s_devices["rejax"]["wall"])
    report.goal("steps_per_s_vs_rejax_8_seeds (one device each)", r1["ratio"], 1.2, row=r1)
    print(f"8 seeds: ratio {r1['ratio']:.2f} on one device, {r['ratio']:.2f} with tide over {n_dev} devices",
          flush=True)

    # SAC on Pendulum-v1, one device each
    sac_efficiency: dict = {}
    for n in (4,) if quick else (4, 64):
        u = 512 if quick else 2_048  # updates (= gradient steps) per timed call
        s = measure({"tide": (tide_sac_step(n, u), n * u), "rejax": (rejax_sac_step(n, u), n * u)}, repeats)
        r = report.add(f"sac_pendulum_num_envs_{n}", "tide SAC", "rejax SAC", "env_steps_per_s", s["tide"]["wall"],
                       s["rejax"]["wall"], gradient_steps_per_env_step=SAC_GRADIENT_STEPS / n)
        report.add(f"sac_pendulum_num_envs_{n}_cpu", "tide SAC", "rejax SAC", "env_steps_per_cpu_s", s["tide"]["cpu"],
                   s["rejax"]["cpu"])
        report.goal(f"sac_steps_per_s_vs_rejax_num_envs_{n}", r["ratio"], 1.2, row=r)
        # Not a goal: rejax with the products on the library tide's SAC picks, in its own alternation with tide
        s_eigen = measure({"tide": (tide_sac_step(n, u), n * u),
                           "rejax_eigen": (rejax_sac_step(n, u, cpu_matmul="eigen"), n * u)}, repeats)
        re = report.add(f"sac_pendulum_num_envs_{n}_vs_rejax_on_eigen_dots", "tide SAC", "rejax SAC (cpu_matmul eigen)",
                        "env_steps_per_s", s_eigen["tide"]["wall"], s_eigen["rejax_eigen"]["wall"])
        # What the update is made of: its FLOPs (XLA's count, the same math on both sides) at each side's rate
        flops = sac_update_flops(n)
        sac_efficiency[f"num_envs_{n}"] = {
            "mflops_per_update": flops / 1e6,
            "tide_gflops_per_s": flops * r["contender_median"] / n / 1e9,
            "rejax_gflops_per_s": flops * r["baseline_median"] / n / 1e9,
            "tide_ms_per_update": 1e3 * n / r["contender_median"],
            "rejax_ms_per_update": 1e3 * n / r["baseline_median"]}
        print(f"SAC num_envs {n}: tide {r['contender_median']:.0f}/s rejax {r['baseline_median']:.0f}/s "
              f"ratio {r['ratio']:.2f} (rejax on eigen dots: ratio {re['ratio']:.2f}); "
              f"{sac_efficiency[f'num_envs_{n}']}", flush=True)
    report.note("sac_compute", {**sac_efficiency, "what": (
        "FLOPs of one SAC update (num_envs env steps + 1 gradient step; XLA cost analysis of tide's update, the "
        "same math on both sides) times each side's updates per second, and each side's milliseconds per update; "
        "tide's SAC runs its products on Eigen (jax.cpu_matmul, as configs/pendulum_sac.yaml sets it), rejax on "
        "XLA's default, YNNPACK")})

    # jax.cpu_matmul, no goal: tide with its products on Eigen against tide on YNNPACK (XLA's default), the same
    # program otherwise; the reason tide's SAC config picks Eigen and PPO keeps the default
    u_sac, u_ppo4, u_ppo2048 = (512 if quick else 2_048), updates_for(4, chunk_steps), updates_for(2048, chunk_steps)
    pairs = {"sac_pendulum_num_envs_4": lambda lib: (tide_sac_step(4, u_sac, cpu_matmul=lib), 4 * u_sac),
             "cartpole_num_envs_4": lambda lib: (tide_engine(4, u_ppo4, cpu_matmul=lib), 4 * NUM_STEPS * u_ppo4),
             "cartpole_num_envs_2048": lambda lib: (tide_engine(2048, u_ppo2048, cpu_matmul=lib),
                                                    2048 * NUM_STEPS * u_ppo2048)}
    for name, make in list(pairs.items())[: 2 if quick else 3]:
        s = measure({"eigen": make("eigen"), "ynnpack": make("ynnpack")}, repeats)
        r = report.add(f"{name}_cpu_matmul_eigen_vs_ynnpack", "tide, cpu_matmul eigen", "tide, cpu_matmul ynnpack",
                       "env_steps_per_s", s["eigen"]["wall"], s["ynnpack"]["wall"])
        print(f"{name}: Eigen / YNNPACK products {r['ratio']:.2f}", flush=True)

    # IMPALA-style learner vs PPO, both tide, same env, envs, rollout length and learning rate
    u = IMPALA_VS_PPO["updates_per_iteration"]
    s = measure({"impala": (chunk_step(impala_or_ppo_engine("impala")), 16 * 32 * u),
                 "ppo": (chunk_step(impala_or_ppo_engine("ppo")), 16 * 32 * u)}, repeats)
    r = report.add("impala_vs_ppo_cartpole_steps_per_s", "tide IMPALA (lag 1, 4 learner steps)",
                   "tide PPO (4 epochs x 4 minibatches)", "env_steps_per_s", s["impala"]["wall"], s["ppo"]["wall"])
    solved = {a: [impala_or_ppo_solve(a, seed) for seed in (0, 1, 2)] for a in ("impala", "ppo")}
    for i, what in enumerate(("seconds", "env_steps")):
        a, b = ([math.inf if x[i] is None else x[i] for x in solved[k]] for k in ("impala", "ppo"))
        report.add(f"impala_vs_ppo_cartpole_{what}_to_training_return_475", "tide IMPALA", "tide PPO",
                   f"{what} until a chunk's mean training return >= 475 (inf = not within 40 chunks)", a, b,
                   higher_is_better=False, seeds=[0, 1, 2])
    print(f"IMPALA vs PPO: steps/s ratio {r['ratio']:.2f}; to 475: {solved}", flush=True)

    # wall seconds to mean return 475, compile included: seeds 0, 1, 2 per side (quick: no PyTorch)
    solve_seeds = (0, 1, 2)
    cap = 30.0 if quick else 240.0
    solve: dict[str, list] = {"tide": [], "rejax": [], "torch": []}
    for seed in solve_seeds:
        solve["tide"].append(solve_tide(cap, seed))
        solve["rejax"].append(solve_rejax(cap, seed))
        if not quick:  # the Python-loop PPO needs about a minute to solve: full mode only
            solve["torch"].append(solve_torch(cap, seed))
        print(f"solve seconds: {[(k, v[-1]) for k, v in solve.items() if v]}", flush=True)
    for base in ("rejax", "torch") if not quick else ("rejax",):
        # a run that never reaches the target counts as inf seconds, on either side
        a, b = ([math.inf if x is None else x for x in solve[k]] for k in ("tide", base))
        report.add(f"seconds_to_return_475_vs_{base}", "tide", base,
                   f"seconds_to_return_475 (inf = not reached within {cap:.0f} s)", a, b, higher_is_better=False,
                   seeds=list(solve_seeds))

    report.note("notes", f"{repeats} alternating repeats per throughput figure; solve runs with seeds {solve_seeds} "
                "each; "
                "rollout length 128, 4 epochs x 4 minibatches, 64x64 tanh MLPs for all; "
                "PyTorch baseline at 4 envs with torch.set_num_threads(1). Every goal compares one device with "
                "one device; 8 seeds over the host CPU devices (as `tide run` lays seeds out) is a row beside "
                "the goal. tide's PPO bootstraps episodes cut by the time limit (one more critic pass over the "
                "rollout); rejax treats the cut as the episode's end.")
    report.finish()


if __name__ == "__main__":
    main()
