"""`tide inspect`'s PNG: wall time per iteration split by what ran (one phase alone, phases at once, none), a
timeline of a few iterations per role where phases overlap (rollout.max_staleness 1), the reward, and the training
signals (loss, KL to the reference, entropy, completion length). Every legend sits outside its plot."""
from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from matplotlib.ticker import MaxNLocator

from orchestrator.run.wall_time import (OVERLAPPED, PHASE_ORDER, ROLE_PHASES, WallTime, is_startup, iteration_windows,
                                  per_iteration, phase_key)

PHASE_COLORS = {"rollout": "#1f77b4", "rollout_ahead": "#17becf", "reward": "#bcbd22", "old_logprobs": "#ff7f0e",
                "reference": "#8c564b", "train": "#d62728", "publish": "#9467bd", "drain": "#7f7f7f",
                "ahead_check": "#e377c2", "sync": "#2ca02c", "probe": "#dbdb8d", "eval": "#ffbb78",
                "checkpoint": "#393b79", "compile": "#c49c94"}
OTHER_COLORS = ["#aec7e8", "#98df8a", "#ff9896", "#c5b0d5", "#f7b6d2", "#9edae5"]
UNTIMED_COLOR = "#d9d9d9"
# Timeline lanes, top to bottom: the batch drawn ahead on a lane of its own, as it runs beside the other phases
LANES = ["driver", "trainer", "engines", "engines: next batch"]
LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": 8, "frameon": False}


def phase_color(phase: str) -> str:
    if phase in PHASE_COLORS:
        return PHASE_COLORS[phase]
    return OTHER_COLORS[(PHASE_ORDER.index(phase) if phase in PHASE_ORDER else len(phase)) % len(OTHER_COLORS)]


def lane(phase: str) -> str:
    if phase in OVERLAPPED:
        return "engines: next batch"
    return next((role for role, phases in ROLE_PHASES.items() if phase in phases), "driver")


def plot_run(timings: list[dict], metrics: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = run_figure(timings, metrics, title)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def run_figure(timings: list[dict], metrics: list[dict], title: str):
    """The figure `plot_run` saves (Agg: pyplot's figure, closed by the caller)."""
    import matplotlib.pyplot as plt

    per = per_iteration(timings)
    llm = bool(metrics) and "loss" in metrics[0]
    overlap = any(w.overlapped for w in per.values())
    rows = ["wall"] + (["timeline"] if overlap else []) + ["reward"] + (["training"] if llm else [])
    heights = {"wall": 3.2, "timeline": 2.0, "reward": 2.2, "training": 2.2}
    fig = plt.figure(figsize=(13, 1.2 + sum(heights[r] for r in rows)), layout="constrained")
    grid = fig.add_gridspec(len(rows), 3, height_ratios=[heights[r] for r in rows])
    wall_ax = fig.add_subplot(grid[0, :])
    wall_panel(wall_ax, per, title)
    if overlap:
        timeline_panel(fig.add_subplot(grid[1, :]), timings)
    reward_ax = fig.add_subplot(grid[rows.index("reward"), :], sharex=wall_ax)
    reward_panel(reward_ax, metrics)
    if llm:
        training_panels([fig.add_subplot(grid[rows.index("training"), k]) for k in range(3)], metrics)
    else:
        reward_ax.set_xlabel("iteration")
    return fig


def beside_background(w: WallTime) -> dict[str, float]:
    """The overlapped time of an iteration, each instant given to one phase: the one the driver waited on (a
    batch drawn ahead runs beside it), so that the bar still reads as the driver's sequence of phases."""
    out: dict[str, float] = defaultdict(float)
    for phases, seconds in w.together.items():
        out[([p for p in phases if p not in OVERLAPPED] or list(phases))[0]] += seconds
    return out


def wall_panel(ax, per: dict[int, WallTime], title: str) -> None:
    """A bar per iteration as tall as its wall time, stacked by what ran: each phase alone (solid), a phase while
    another ran beside it (hatched, counted once), none (grey); a tick where the bar would end if its phases ran
    one after the other."""
    from matplotlib.patches import Patch

    its = sorted(per)
    hidden = {i: beside_background(per[i]) for i in its}
    phases = sorted({p for i in its for p, s in (*per[i].alone.items(), *hidden[i].items()) if s > 0}, key=phase_key)
    bottom = [0.0] * len(its)

    def stack(values: list[float], **style) -> None:
        nonlocal bottom
        ax.bar(its, values, bottom=bottom, width=0.85, linewidth=0, **style)
        bottom = [b + v for b, v in zip(bottom, values)]

    for p in phases:
        stack([per[i].alone.get(p, 0.0) for i in its], color=phase_color(p), label=p)
        if any(hidden[i].get(p) for i in its):
            stack([hidden[i].get(p, 0.0) for i in its], color=phase_color(p), hatch="////", edgecolor="white")
    stack([per[i].untimed for i in its], color=UNTIMED_COLOR, label="untimed (between phases)")
    handles, labels = ax.get_legend_handles_labels()
    if any(per[i].overlapped for i in its):
        summed = [sum(per[i].alone.values()) + sum(per[i].beside.values()) + per[i].untimed for i in its]
        ticks = ax.scatter(its, summed, marker="_", color="black", s=60 if len(its) < 40 else 20, zorder=3)
        handles += [Patch(facecolor="white", edgecolor="#444444", hatch="////"), ticks]
        labels += [f"hatched: overlapped, the phase ran\nbeside {' / '.join(sorted(OVERLAPPED))}\n"
                   "(each second counted once)", "phases one after another\n(no overlap) would end here"]
    _clip_outliers(ax, its, bottom)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("wall seconds")
    ax.set_title(f"{title}: wall time per iteration, by what ran (start-up and warm start: see the table)",
                 fontsize=10)
    ax.legend(handles, labels, **LEGEND)
    ax.grid(axis="y", alpha=0.3)


def timeline_iterations(windows: dict[int, tuple[float, float]], count: int = 3) -> list[int]:
    """A few consecutive iterations from the middle of the run (past the first's warm-up)."""
    its = sorted(windows)
    mid = max(len(its) // 2 - count // 2, 1 if len(its) > count else 0)
    return its[mid:mid + count]


def timeline_panel(ax, timings: list[dict]) -> None:
    """A few iterations as they ran: a lane per role, each phase a bar from its start to its end."""
    windows = iteration_windows(timings)
    shown = timeline_iterations(windows)
    lo, hi = windows[shown[0]][0], windows[shown[-1]][1]
    drawn: set[str] = set()
    for r in timings:
        a, b = max(r["start"], lo), min(r["start"] + r["seconds"], hi)
        if b <= a or is_startup(r["phase"]):
            continue
        y = len(LANES) - 1 - LANES.index(lane(r["phase"]))
        ax.broken_barh([(a - lo, b - a)], (y - 0.35, 0.7), facecolors=phase_color(r["phase"]),
                       label=None if r["phase"] in drawn else r["phase"])
        drawn.add(r["phase"])
    for it in shown:
        start = windows[it][0] - lo
        ax.axvline(start, color="black", linewidth=0.8, linestyle=":")
        ax.text(start, len(LANES) - 0.45, f" iteration {it}", fontsize=8, va="bottom")
    ax.set_yticks(range(len(LANES)), list(reversed(LANES)), fontsize=8)
    ax.set_ylim(-0.6, len(LANES) - 0.1)
    ax.set_xlim(0, hi - lo)
    ax.set_xlabel(f"seconds from the start of iteration {shown[0]}")
    ax.set_title("timeline: what ran at once (each role's phases; the next batch is sampled beside train)",
                 fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda k: phase_key(labels[k]))
    ax.legend([handles[k] for k in order], [labels[k] for k in order], **LEGEND)
    ax.grid(axis="x", alpha=0.3)


def reward_panel(ax, metrics: list[dict]) -> None:
    """The reward (solid), accuracy (dashed, another colour: where it equals the reward both stay visible) and
    the held-out pass@1 (squares)."""
    key = next((k for k in ("reward_mean", "episode_return_mean") if metrics and k in metrics[0]), None)
    if key is None:
        return
    its = [m["iteration"] for m in metrics]
    ax.plot(its, [m.get(key, float("nan")) for m in metrics], color="tab:blue", linewidth=2.5, alpha=0.6,
            marker="o", markersize=4 if len(its) < 40 else 0, label=key)
    ax.set_ylabel(key)
    if "accuracy" in metrics[0]:
        acc = [m.get("accuracy", float("nan")) for m in metrics]
        same = all(a == m.get(key) for a, m in zip(acc, metrics))
        ax.plot(its, acc, color="tab:orange", linewidth=1.2, linestyle="--", marker="x",
                markersize=5 if len(its) < 40 else 0, label=f"accuracy{' (= ' + key + ' here)' if same else ''}")
    evals = [m for m in metrics if "eval/pass@1" in m]
    if evals:
        ax.plot([m["iteration"] for m in evals], [m["eval/pass@1"] for m in evals], color="tab:green",
                linestyle="none", marker="s", markersize=5, label="eval pass@1 (greedy)")
    ax.legend(**LEGEND)
    ax.grid(alpha=0.3)


def training_panels(axes, metrics: list[dict]) -> None:
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
    loss_ax.set_title("loss" + (" and kl_ref" if "kl_ref" in metrics[0] else ""), fontsize=9)
    entropy_ax.plot(its, series("entropy"), color="tab:green")
    entropy_ax.set_title("entropy (nats per token)", fontsize=9)
    length_ax.plot(its, series("completion_len"), color="tab:purple", label="mean")
    length_ax.fill_between(its, series("completion_len_min"), series("completion_len_max"), color="tab:purple",
                           alpha=0.2, label="min-max")
    length_ax.set_title("completion tokens (mean, min-max)", fontsize=9)
    cut = length_ax.twinx()
    cut.plot(its, series("clipped_ratio"), color="tab:red", alpha=0.6, linestyle="--")
    cut.set_ylim(0, 1.05)
    cut.set_ylabel("share cut at max_new_tokens", fontsize=8, color="tab:red")
    for ax in axes:
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
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
