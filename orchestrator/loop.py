"""One RL iteration after another: rollout -> reward -> train -> publish -> sync (-> checkpoint)."""
from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from orchestrator.session import Session, console


def run_iterations(s: Session) -> None:
    cfg, run = s.cfg, s.run
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        bar = progress.add_task(cfg.name, total=cfg.iterations, completed=s.start_iteration)
        for it in range(s.start_iteration + 1, cfg.iterations + 1):
            problems = s.problems(it)
            with run.phase(it, "rollout"):
                progress.update(bar, description=f"{cfg.name} · rollout")
                samples = s.generate(problems, it)
            with run.phase(it, "reward"):
                reward = s.score(problems, samples)
            with run.phase(it, "train"):
                progress.update(bar, description=f"{cfg.name} · train")
                train = s.train(samples)
            with run.phase(it, "publish") as rec:
                manifest = s.publish(it)
                rec["bytes"] = manifest.nbytes
            with run.phase(it, "sync") as rec:
                progress.update(bar, description=f"{cfg.name} · sync ({cfg.rollout.sync_mode})")
                gap = s.sync(manifest)
                rec["bytes"] = manifest.nbytes
            s.record(it, {**reward, "logprob_gap": gap, "loss": train["loss"], "grad_norm": train["grad_norm"],
                          "sq_log_ratio": train["sq_log_ratio"], "samples": len(samples), **s.last_pull})
            console.log(f"iter {it:>3}  reward {reward['reward_mean']:.3f}  acc {reward['accuracy']:.3f}  "
                        f"loss {train['loss']:+.4f}  gap {gap:.2e}")
            s.check_gap(it, gap)
            if it % cfg.save_every == 0 or it == cfg.iterations:
                with run.phase(it, "checkpoint"):
                    progress.update(bar, description=f"{cfg.name} · checkpoint")
                    s.checkpoint(it)
            progress.update(bar, advance=1, description=cfg.name)
    s.write_final(cfg.iterations)
