"""The orchestration of `engine: jax` runs: one tide iteration is one jitted chunk of updates (PPO, SAC or IMPALA).

Writes the same run directory as the LLM loop: a `compile` phase (first iteration only) and a `train`
phase per chunk in timings.jsonl, one metrics.jsonl record per iteration, Orbax checkpoints of the whole
runner state (parameters, optimizers, env states, observations, raw PRNG keys, SAC's replay buffer) through
`RunDir.writing_checkpoint`, so a resumed run continues bit-for-bit where the checkpoint left off."""
from __future__ import annotations

import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from orchestrator.config.schema import TideConfig
from orchestrator.records.rundir import RunDir

STATE_DIR = "state"


def run_jax(cfg: TideConfig, run: RunDir, resume: bool, *, stop_after: int | None = None,
            show_progress: bool = True) -> None:
    """Train for `cfg.iterations` iterations (or resume from the newest checkpoint).
    `stop_after`: return after that iteration as if killed (tests simulate an interruption with it)."""
    import jax  # deferred: importing the orchestrator must not import jax

    from trainer.jax.engine import Engine, enable_compilation_cache, summarize, use_cpu_cores

    jcfg = cfg.jax
    assert jcfg is not None, "engine 'jax' needs a `jax:` section"
    use_cpu_cores(jcfg.cpu_devices)  # before anything starts JAX's backends
    enable_compilation_cache(jcfg.compilation_cache_dir)
    engine = Engine(jcfg, total_updates=cfg.iterations * jcfg.updates_per_iteration, seed=cfg.seed)

    start_iter, env_steps, wall_before = 0, 0, 0.0
    ckpt = run.latest_checkpoint() if resume else None
    if ckpt is not None:
        rs = run.read_run_state(ckpt)
        start_iter, env_steps, wall_before = rs["iteration"], rs["env_steps"], rs.get("wall_seconds", 0.0)
        run.truncate_after(start_iter)
        state = engine.restore(ckpt / STATE_DIR)
    else:
        state = engine.init_state()

    last = cfg.iterations if stop_after is None else min(stop_after, cfg.iterations)
    steps_per_iter = engine.steps_per_chunk // jcfg.seeds  # per agent
    t_start = time.perf_counter()
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), disable=not show_progress)
    with progress:
        task = progress.add_task(f"{cfg.name} ({jcfg.env})", total=cfg.iterations, completed=start_iter, info="")
        for it in range(start_iter + 1, last + 1):
            if it == start_iter + 1:
                with run.phase(it, "compile"):
                    engine.compile(state)
            with run.phase(it, "train"):
                t0 = time.perf_counter()
                state, metrics = engine.run_chunk(state)
                jax.block_until_ready(state)
                seconds = time.perf_counter() - t0
            env_steps += steps_per_iter
            summary = summarize(metrics)
            ret = summary["episode_return_mean"]
            record = {
                "iteration": it,
                **summary,
                "env_steps": env_steps,
                "steps_per_second": engine.steps_per_chunk / seconds,
                "solved": ret is not None and ret >= jcfg.target_return,
                "wall_seconds": wall_before + time.perf_counter() - t_start,
            }
            run.log_metrics(record)
            if it % cfg.save_every == 0 or it == cfg.iterations:
                with run.phase(it, "checkpoint"):
                    run_state = {"iteration": it, "env_steps": env_steps, "wall_seconds": record["wall_seconds"],
                                 "engine": "jax"}
                    with run.writing_checkpoint(it, run_state) as tmp:
                        engine.save(tmp / STATE_DIR, state)
                    run.prune_checkpoints(cfg.keep_checkpoints)
            info = f"return {ret:.1f}" if ret is not None else ""
            progress.update(task, completed=it, info=f"{info}  {record['steps_per_second']:.0f} steps/s")
