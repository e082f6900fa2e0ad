"""`tide inspect`: how the run ended (or that it is running), the per-phase table (count, median, total, share of
the wall time), the overlap of the phases that ran at once (rollout.max_staleness 1: the next batch sampled while
this one trains), the share of the steady state each side (engines, trainer) sat idle, and a PNG
(orchestrator/run/inspect_plot.py) of wall time per iteration, a timeline of a few iterations where phases overlap,
reward, and the training signals beside it (loss, KL to the reference, entropy, completion length).

Shares are shares of wall time, so that they add to 100% whether phases overlap or not: a profile's wall time is
split by what ran, each instant counted once: one phase alone (that phase's share), two or more at once (the
`overlapped` row: time saved against running them one after the other), none (`untimed`: the driver between
phases, logging the metrics)."""
from __future__ import annotations

import statistics
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from orchestrator.records.rundir import RunDir, read_jsonl
from orchestrator.run.wall_time import (WallTime, idle_shares, is_startup, per_iteration, phase_table, sessions,
                                        wall_time)


def engines_started_beside_trainer(run: RunDir) -> bool:
    """Engines reloading in place start on the base model while the trainer starts (orchestrator/iteration/session.py):
    their start-up row times only what was left of it once the trainer was ready."""
    try:
        cfg = yaml.safe_load(run.config_file.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return False
    rollout, transfer = cfg.get("rollout") or {}, cfg.get("transfer") or {}
    return cfg.get("engine", "llm") != "jax" and rollout.get("sync_mode") == "reload" and not transfer.get("enabled")


def engine_start_note(timings: list[dict]) -> str | None:
    """What the startup/engines row of a run whose engines start beside the trainer means, and the longest their
    start can have taken: from their launch (just before startup/trainer) to the end of that wait."""
    last = {r["phase"]: r for r in timings if is_startup(r["phase"])}  # the latest session's
    trainer, engines = last.get("startup/trainer"), last.get("startup/engines")
    if trainer is None or engines is None:
        return None
    ready = engines["start"] + engines["seconds"] - trainer["start"]
    return (f"startup/engines ({engines['seconds']:.3f} s) is the wait for the engines once the trainer was ready: "
            f"launched just before startup/trainer, they start beside it (and the warm start) and were serving "
            f"{ready:.1f} s after their launch at the latest")


def table_caption(split: WallTime) -> str:
    return ("share: of the wall time (from the first phase's start to the last phase's end, each process of a "
            f"resumed run apart: {split.wall:.1f} s): a phase's time alone; time two or more phases ran at once "
            "counts once, in `overlapped`; `untimed`: no phase ran (the driver between phases). The shares add to "
            "100%. "
            "overlapped s: the part of a phase's total it ran beside another phase")


def overlap_lines(split: WallTime, limit: int = 6) -> list[str]:
    """Which phases ran at once, longest first."""
    if not split.overlapped:
        return []
    top = sorted(split.together.items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{' + '.join(k)} {v:.2f} s" for k, v in top[:limit])
    rest = top[limit:]
    more = f", {len(rest)} more combinations ({sum(v for _, v in rest):.2f} s)" if rest else ""
    return [f"overlapped {split.overlapped:.2f} s ({split.overlapped / (split.wall or 1):.0%} of the wall time): "
            f"{shown}{more}"]


def steady_state_line(per: dict[int, WallTime]) -> str | None:
    """Iteration 2 on (the first carries the engines' first-use warm-up): the median iteration's wall time
    against its phases' seconds added up, the difference being the time phases overlapped."""
    steady = [w for it, w in sorted(per.items())[1:]]
    if not steady:
        return None
    wall = statistics.median(w.wall for w in steady)
    summed = statistics.median(sum(w.alone.values()) + sum(w.beside.values()) for w in steady)
    saved = statistics.median(sum(w.beside.values()) - w.overlapped for w in steady)
    line = f"per iteration (median of iterations 2 on): wall {wall:.3f} s; its phases add to {summed:.3f} s"
    return line + (f", {saved:.3f} s of them overlapped" if saved > 0 else "")


def phase_rich_table(run: RunDir, rows: list[dict], split: WallTime) -> Table:
    table = Table(title=f"{run.name}: time per phase", caption=table_caption(split), caption_justify="left")
    for col in ("phase", "count", "median s", "total s", "overlapped s", "share"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for r in rows:
        if "count" not in r:
            continue
        table.add_row(r["phase"], str(r["count"]), f"{r['median_s']:.3f}", f"{r['total_s']:.2f}",
                      f"{r['overlapped_s']:.2f}" if r["overlapped_s"] >= 0.005 else "", f"{r['share']:.1%}")
    table.add_section()
    for r in rows:
        if "count" not in r:
            table.add_row(r["phase"], "", "", f"{r['total_s']:.2f}", "", f"{r['share']:.1%}")
    table.add_row("wall time", "", "", f"{split.wall:.2f}", "", f"{sum(r['share'] for r in rows):.1%}")
    return table


def inspect_run(run: RunDir, plot: bool = True, console: Console | None = None) -> Path | None:
    console = console or Console()
    timings, metrics = run.timings(), run.metrics()
    split = wall_time(timings) if timings else WallTime()
    console.print(phase_rich_table(run, phase_table(timings) if timings else [], split))
    notes = overlap_lines(split)
    per = per_iteration(timings)
    if line := steady_state_line(per):
        notes.append(line)
    if engines_started_beside_trainer(run) and (note := engine_start_note(timings)):
        notes.append(note)
    idle = idle_shares(timings)
    if idle and metrics and "loss" in metrics[0]:  # an LLM run (JAX runs have no such roles)
        between = " (the time between the run's processes left out)" if len(sessions(timings)) > 1 else ""
        notes.append(f"idle from the end of iteration 1 on{between}: " + ", ".join(f"{role} {share:.0%}"
                                                                                 for role, share in idle.items()))
    for note in notes:
        console.print(note)
    status = run.status()
    if status:
        where = f"iteration {status.get('iteration')}, phase {status.get('phase')}"
        line = {"finished": "finished", "running": f"running ({where})",
                "restarting": f"restarting (restart {status.get('restarts')} after: {status.get('error')})"}.get(
            status.get("state"), f"failed at {where}: {status.get('error')}")
        console.print(f"status: {line}")
        for r in read_jsonl(run.restarts_file):
            console.print(f"restart {r['restart']}: from iteration {r['from_iteration']} after exit {r['exit_code']}: "
                          f"{r['error']}")
    if metrics:
        last = metrics[-1]
        key = "reward_mean" if "reward_mean" in last else "episode_return_mean"
        console.print(f"{len(metrics)} iterations; {key}: first {metrics[0].get(key)}, last {last.get(key)}")
    if not plot:
        return None
    from orchestrator.run.inspect_plot import plot_run

    out = run.path / "timings.png"
    plot_run(timings, metrics, out, title=run.name)
    console.print(f"wrote {out}")
    return out
