"""`tide inspect`: how the run ended (or that it is running), the per-phase table (count, median, total, share),
the share of the steady state each side (engines, trainer) sat idle, and a PNG of phase time per iteration,
reward, and the training signals beside it (loss, KL to the reference, entropy, completion length)."""
from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from orchestrator.rundir import RunDir, read_jsonl

PHASE_ORDER = ["startup/ray", "startup/trainer", "startup/engines", "warmup", "compile", "rollout", "rollout_ahead",
               "reward", "old_logprobs", "reference", "train", "publish", "drain", "ahead_check", "sync", "probe",
               "eval", "checkpoint"]
# Timed while other phases ran (rollout.max_staleness 1: the next batch sampled during train and publish): shown,
# but outside the total the shares divide
OVERLAPPED = {"rollout_ahead"}


def phase_table(timings: list[dict]) -> list[dict]:
    by_phase: dict[str, list[float]] = defaultdict(list)
    for r in timings:
        by_phase[r["phase"]].append(r["seconds"])
    total = sum(sum(v) for p, v in by_phase.items() if p not in OVERLAPPED) or 1.0
    order = sorted(by_phase, key=lambda p: (PHASE_ORDER.index(p) if p in PHASE_ORDER else len(PHASE_ORDER), p))
    return [{"phase": p, "count": len(by_phase[p]), "median_s": statistics.median(by_phase[p]),
             "total_s": sum(by_phase[p]), "share": sum(by_phase[p]) / total} for p in order]


# Which side of an LLM run each phase keeps busy (the reward, the drain and the probe's scoring: the driver's)
ROLE_PHASES = {"engines": {"rollout", "rollout_ahead", "sync", "probe", "eval"},
               "trainer": {"old_logprobs", "reference", "train", "publish", "ahead_check", "checkpoint"}}


def iteration_ends(timings: list[dict]) -> dict[int, float]:
    """Each iteration's end: the latest end of its phases (a batch drawn ahead ends before its iteration does)."""
    ends: dict[int, float] = {}
    for t in timings:
        if isinstance(t.get("iteration"), int) and t["iteration"] > 0:
            ends[t["iteration"]] = max(ends.get(t["iteration"], 0.0), t["start"] + t["seconds"])
    return ends


def idle_shares(timings: list[dict]) -> dict[str, float] | None:
    """From the end of iteration 1 to the end of the last (start-up, compilation and first-use warm-up left out):
    the share of that time each role's phases left it idle, overlapping phases counted once. None: fewer than two
    iterations."""
    ends = iteration_ends(timings)
    if len(ends) < 2:
        return None
    lo, hi = ends[min(ends)], max(ends.values())
    out = {}
    for role, phases in ROLE_PHASES.items():
        spans = sorted((max(r["start"], lo), min(r["start"] + r["seconds"], hi)) for r in timings
                       if r["phase"] in phases)
        busy, reach = 0.0, lo
        for a, b in spans:  # the union of the spans, clipped to the window
            a = max(a, reach)
            if b > a:
                busy, reach = busy + b - a, b
        out[role] = 1.0 - busy / (hi - lo) if hi > lo else 0.0
    return out


def inspect_run(run: RunDir, plot: bool = True, console: Console | None = None) -> Path | None:
    console = console or Console()
    timings, metrics = run.timings(), run.metrics()
    rows = phase_table(timings)
    table = Table(title=f"{run.name}: time per phase")
    for col in ("phase", "count", "median s", "total s", "share"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for r in rows:
        table.add_row(r["phase"], str(r["count"]), f"{r['median_s']:.3f}", f"{r['total_s']:.2f}", f"{r['share']:.1%}")
    console.print(table)
    idle = idle_shares(timings)
    if idle and metrics and "loss" in metrics[0]:  # an LLM run (JAX runs have no such roles)
        console.print("idle from the end of iteration 1 on: " + ", ".join(f"{role} {share:.0%}"
                                                                        for role, share in idle.items()))
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
    out = run.path / "timings.png"
    plot_run(timings, metrics, out, title=run.name)
    console.print(f"wrote {out}")
    return out


def plot_run(timings: list[dict], metrics: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = sorted({r["iteration"] for r in timings if r["iteration"] > 0})
    phases = [p for p in PHASE_ORDER if any(r["phase"] == p and r["iteration"] > 0 for r in timings)]
    phases += sorted({r["phase"] for r in timings if r["iteration"] > 0} - set(phases))
    per = defaultdict(float)
    for r in timings:
        per[(r["iteration"], r["phase"])] += r["seconds"]
    llm = bool(metrics) and "loss" in metrics[0]
    fig = plt.figure(figsize=(11, 10 if llm else 7))
    grid = fig.add_gridspec(3 if llm else 2, 3)
    ax1 = fig.add_subplot(grid[0, :])
    ax2 = fig.add_subplot(grid[1, :], sharex=ax1)
    bottom = [0.0] * len(its)
    for p in phases:
        vals = [per[(i, p)] for i in its]
        ax1.bar(its, vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals)]
    _clip_outliers(ax1, its, bottom)
    ax1.set_ylabel("seconds")
    ax1.set_title(f"{title}: time per phase per iteration (start-up and warm start: see the table)")
    ax1.legend(loc="upper right", fontsize=8, ncol=3)
    key = next((k for k in ("reward_mean", "episode_return_mean") if metrics and k in metrics[0]), None)
    if key:
        ax2.plot([m["iteration"] for m in metrics], [m[key] for m in metrics], marker="o", label=key)
        ax2.set_ylabel(key)
        if "accuracy" in metrics[0]:
            ax2.plot([m["iteration"] for m in metrics], [m["accuracy"] for m in metrics], marker=".", alpha=0.6,
                     label="accuracy")
        evals = [m for m in metrics if "eval/pass@1" in m]
        if evals:
            ax2.plot([m["iteration"] for m in evals], [m["eval/pass@1"] for m in evals], marker="s",
                     label="eval pass@1 (greedy)")
        if "accuracy" in metrics[0] or evals:
            ax2.legend(loc="lower right", fontsize=8)
    ax2.grid(alpha=0.3)
    if llm:
        _training_panels([fig.add_subplot(grid[2, k], sharex=ax1) for k in range(3)], metrics)
    else:
        ax2.set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _training_panels(axes, metrics: list[dict]) -> None:
    """Loss (and the KL to the reference), entropy of the sampling distribution, completion length (mean, with
    the min-max range, and the share cut at max_new_tokens)."""
    its = [m["iteration"] for m in metrics]

    def series(key: str) -> list[float]:
        return [m.get(key, float("nan")) for m in metrics]

    loss_ax, entropy_ax, length_ax = axes
    loss_ax.plot(its, series("loss"), label="loss")
    if "kl_ref" in metrics[0]:
        loss_ax.plot(its, series("kl_ref"), label="kl_ref")
    loss_ax.legend(fontsize=8)
    loss_ax.set_title("loss", fontsize=9)
    entropy_ax.plot(its, series("entropy"), color="tab:green")
    entropy_ax.set_title("entropy (nats per token)", fontsize=9)
    length_ax.plot(its, series("completion_len"), color="tab:purple", label="mean")
    length_ax.fill_between(its, series("completion_len_min"), series("completion_len_max"), color="tab:purple",
                           alpha=0.2, label="min-max")
    length_ax.set_title("completion tokens", fontsize=9)
    cut = length_ax.twinx()
    cut.plot(its, series("clipped_ratio"), color="tab:red", alpha=0.6, linestyle="--")
    cut.set_ylim(0, 1.05)
    cut.set_ylabel("share cut at max_new_tokens", fontsize=8, color="tab:red")
    for ax in axes:
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)


def _clip_outliers(ax, iterations: list[int], totals: list[float], factor: float = 3.0) -> None:
    """Iterations far above the median (the first one carries the engines' first-use warm-up) would flatten
    every other bar: the axis stops at `factor` x the median and those bars are labelled with their total."""
    if not totals:
        return
    cap = factor * statistics.median(totals)
    if max(totals) <= cap or cap <= 0:
        return
    ax.set_ylim(0, cap * 1.08)
    for it, total in zip(iterations, totals):
        if total > cap:
            ax.annotate(f"\u2191 {total:.1f} s", (it, cap), textcoords="offset points", xytext=(0, 2), ha="center",
                        fontsize=7)
