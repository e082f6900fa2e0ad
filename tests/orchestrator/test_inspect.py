"""`tide inspect` (orchestrator/run/inspect.py, inspect_plot.py) from synthetic timings whose overlap is known: shares
of the wall time that add to 100% with and without a batch drawn ahead, the overlapped seconds computed by hand,
sessions of a resumed run, and the PNG of a 100-iteration asynchronous run."""
import json

import pytest

from orchestrator.run.inspect import inspect_run
from orchestrator.run.wall_time import phase_table
from orchestrator.records.rundir import RunDir


def rec(it, phase, start, end):
    return {"iteration": it, "phase": phase, "start": start, "seconds": round(end - start, 9)}


def sync_timings():
    """Lockstep: every phase one after the other; untimed 4.004-5 and 10.5-11; the engines ready before the
    trainer (the wait 0.004 s)."""
    out = [rec(0, "startup/ray", 0, 1), rec(0, "startup/trainer", 1, 4), rec(0, "startup/engines", 4, 4.004)]
    for it, t in ((1, 5), (2, 11)):
        out += [rec(it, "rollout", t, t + 2), rec(it, "reward", t + 2, t + 2.5), rec(it, "train", t + 2.5, t + 4.5),
                rec(it, "publish", t + 4.5, t + 5), rec(it, "sync", t + 5, t + 5.5)]
    return out


def async_timings():
    """rollout.max_staleness 1: iteration 2's batch drawn 9.2-11.2 (beside reward 0.3 s, old_logprobs 0.5, train
    1.2), iteration 3's 13.2-17.3 (beside ahead_check 0.4, reward 0.2, old_logprobs 0.5, train 2.0, publish 0.5
    and the drain that waits for it 0.5): 6.1 s overlapped; untimed 1-1.2, 6.6-7, 17.8-18: 0.8 s; wall 0-23."""
    out = [rec(0, "startup/ray", 0, 1), rec(0, "startup/trainer", 1.2, 5), rec(0, "warmup", 5, 6),
           rec(0, "startup/engines", 6, 6.5), rec(0, "startup/engine_sync", 6.5, 6.6),
           rec(1, "rollout", 7, 9), rec(1, "reward", 9, 9.5), rec(1, "old_logprobs", 9.5, 10),
           rec(1, "train", 10, 12), rec(1, "publish", 12, 12.5), rec(1, "drain", 12.5, 12.5),
           rec(1, "sync", 12.5, 13), rec(2, "rollout_ahead", 9.2, 11.2)]
    for it, t in ((2, 13), (3, 18)):
        out += [rec(it, "rollout", t, t + 0.1), rec(it, "ahead_check", t + 0.1, t + 0.6),
                rec(it, "reward", t + 0.6, t + 0.8), rec(it, "old_logprobs", t + 0.8, t + 1.3),
                rec(it, "train", t + 1.3, t + 3.3), rec(it, "publish", t + 3.3, t + 3.8)]
    out += [rec(3, "rollout_ahead", 13.2, 17.3), rec(2, "drain", 16.8, 17.3), rec(2, "sync", 17.3, 17.8),
            rec(3, "drain", 21.8, 21.8), rec(3, "sync", 21.8, 22.3), rec(3, "checkpoint", 22.3, 23)]
    return out


def test_lockstep_shares_are_shares_of_the_wall_time():
    rows = {r["phase"]: r for r in phase_table(sync_timings())}
    assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0)
    assert rows["rollout"]["share"] == pytest.approx(4 / 16.5) and rows["train"]["share"] == pytest.approx(4 / 16.5)
    assert rows["untimed"]["total_s"] == pytest.approx(0.996 + 0.5)
    assert rows["overlapped"]["total_s"] == 0 and all(r.get("overlapped_s", 0) == 0 for r in rows.values())


def test_a_batch_drawn_ahead_is_overlap_and_the_shares_still_add_to_the_wall_time():
    rows = {r["phase"]: r for r in phase_table(async_timings())}
    assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0)  # 1.275 when the overlap counted twice
    assert rows["overlapped"]["total_s"] == pytest.approx(6.1)
    assert rows["overlapped"]["share"] == pytest.approx(6.1 / 23)
    assert rows["untimed"]["total_s"] == pytest.approx(0.8)
    assert rows["rollout_ahead"]["total_s"] == pytest.approx(6.1)
    assert rows["rollout_ahead"]["share"] == pytest.approx(0, abs=1e-9)  # never alone: all of it beside others
    assert rows["train"]["overlapped_s"] == pytest.approx(3.2) and rows["train"]["share"] == pytest.approx(2.8 / 23)
    assert rows["drain"]["overlapped_s"] == pytest.approx(0.5) and rows["drain"]["share"] == pytest.approx(0, abs=1e-9)
    assert rows["sync"]["overlapped_s"] == 0 and rows["sync"]["share"] == pytest.approx(1.5 / 23)


def test_the_overlap_by_phase_and_by_iteration():
    from orchestrator.run.wall_time import per_iteration, wall_time
    from orchestrator.run.inspect_plot import beside_background

    split = wall_time(async_timings())
    assert split.wall == pytest.approx(23) and split.overlapped == pytest.approx(6.1)
    assert {k: round(v, 6) for k, v in split.together.items()} == {
        ("rollout_ahead", "reward"): 0.5, ("rollout_ahead", "old_logprobs"): 1.0, ("rollout_ahead", "train"): 3.2,
        ("rollout_ahead", "publish"): 0.5, ("rollout_ahead", "drain"): 0.5, ("rollout_ahead", "ahead_check"): 0.4}
    per = per_iteration(async_timings())
    # iteration 1: from its rollout (7) to its sync's end (13); then each from the end of the one before
    assert {it: (round(w.wall, 6), round(w.overlapped, 6), round(w.untimed, 6)) for it, w in per.items()} == {
        1: (6.0, 2.0, 0.0), 2: (4.8, 4.1, 0.0), 3: (5.2, 0.0, 0.2)}
    # its phases add to 8.9 s (4.8 of its own, 4.1 drawn ahead) in 4.8 s of wall time
    assert sum(per[2].alone.values()) + sum(per[2].beside.values()) == pytest.approx(8.9)
    # the bars give each overlapped second to the phase the driver ran meanwhile
    assert {k: round(v, 6) for k, v in beside_background(per[2]).items()} == {
        "ahead_check": 0.4, "reward": 0.2, "old_logprobs": 0.5, "train": 2.0, "publish": 0.5, "drain": 0.5}


def test_a_resumed_run_counts_each_sessions_wall_time_and_not_its_start_up_as_an_iteration():
    from orchestrator.run.wall_time import idle_shares, iteration_ends, per_iteration, wall_time

    first = [rec(0, "startup/ray", 0, 1), rec(1, "rollout", 2, 3), rec(1, "train", 3, 4), rec(1, "checkpoint", 4, 4.5)]
    # resumed from iteration 1 at t=100: its start-up is recorded under iteration 1
    second = [rec(1, "startup/ray", 100, 101), rec(1, "startup/trainer", 101, 103), rec(2, "rollout", 104, 105),
              rec(2, "train", 105, 106)]
    timings = first + second
    assert wall_time(timings).wall == pytest.approx(4.5 + 6)
    assert sum(r["share"] for r in phase_table(timings)) == pytest.approx(1.0)
    assert iteration_ends(timings) == {1: 4.5, 2: 106}
    assert {it: w.wall for it, w in per_iteration(timings).items()} == {1: pytest.approx(2.5), 2: pytest.approx(2)}
    # iteration 2's 2 s, the rollout (engines) and the train step (trainer) 1 s each: not 101.5 s, 99% idle
    assert idle_shares(timings) == {"engines": pytest.approx(0.5), "trainer": pytest.approx(0.5)}


def test_start_up_rows_lead_the_phase_table():
    timings = [rec(1, "rollout", 10, 11), rec(0, "warmup", 7, 9), rec(0, "startup/engines", 4, 7),
               rec(0, "startup/ray", 0, 4)]
    rows = phase_table(timings)
    assert [r["phase"] for r in rows] == ["startup/ray", "startup/engines", "warmup", "rollout", "overlapped",
                                          "untimed"]
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)


def write_run(path, timings, metrics, config: str | None = None) -> RunDir:
    run = RunDir(path)
    run.timings_file.write_text("".join(json.dumps(t) + "\n" for t in timings))
    run.metrics_file.write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if config is not None:
        run.config_file.write_text(config)
    return run


def hundred_async_iterations() -> list[dict]:
    """async_timings' steady iteration (5 s, 4.1 s of it beside the batch drawn ahead) 100 times, a checkpoint
    every 10."""
    out = [t for t in async_timings() if t["iteration"] <= 1 or (t["iteration"] == 2 and t["phase"] ==
                                                                   "rollout_ahead")]
    steady = [t for t in async_timings() if t["iteration"] == 2 and t["phase"] != "rollout_ahead"]
    steady.append(next(t for t in async_timings() if t["iteration"] == 3 and t["phase"] == "rollout_ahead"))
    for it in range(2, 101):
        shift = 5 * (it - 2)
        for t in steady:
            n = it + 1 if t["phase"] == "rollout_ahead" else it
            if n <= 100:
                out.append(dict(t, iteration=n, start=t["start"] + shift))
        if it % 10 == 0:
            out.append(rec(it, "checkpoint", 17.8 + shift, 17.9 + shift))
    return out


def test_inspect_of_a_100_iteration_asynchronous_run(tmp_path):
    from rich.console import Console

    from orchestrator.run.inspect_plot import run_figure

    metrics = [{"iteration": i, "reward_mean": i / 200, "accuracy": i / 200, "loss": 0.01, "entropy": 1.0,
                "completion_len": 3.0, "completion_len_min": 1, "completion_len_max": 4, "clipped_ratio": 0.1}
               for i in range(1, 101)]
    run = write_run(tmp_path / "async", hundred_async_iterations(), metrics,
                    "rollout: {sync_mode: reload, max_staleness: 1}\ntransfer: {enabled: false}\n")
    console = Console(record=True, width=400)
    assert inspect_run(run, plot=False, console=console) is None
    text = console.export_text()
    assert "wall time" in text and "100.0%" in text and "overlapped 403.80 s" in text
    assert "rollout_ahead + train 197.20 s" in text  # 1.2 + 98 x 2.0
    assert "per iteration (median of iterations 2 on): wall 5.000 s; its phases add to 8.900 s, 4.100 s" in text
    assert "startup/engines (0.500 s) is the wait" in text and "serving 5.3 s after their launch" in text
    fig = run_figure(run.timings(), metrics, "async")  # what plot_run saves
    fig.savefig(tmp_path / "timings.png", dpi=50)
    assert (tmp_path / "timings.png").stat().st_size > 20_000
    axes = [ax for ax in fig.axes if ax.get_legend() is not None]
    assert len(axes) == 3  # wall time, timeline, reward: every legend right of its plot
    for ax in axes:
        legend = ax.get_legend().get_window_extent()
        assert legend.x0 >= ax.get_window_extent().x1, ax.get_title()
    reward_ax = next(ax for ax in fig.axes if ax.get_ylabel() == "reward_mean")
    styles = {line.get_label(): (line.get_linestyle(), line.get_color()) for line in reward_ax.get_lines()}
    assert styles["reward_mean"] != styles["accuracy (= reward_mean here)"]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_inspect_of_a_lockstep_run_without_training_signals(tmp_path):
    metrics = [{"iteration": it, "reward_mean": 0.1 * it, "accuracy": 0.05 * it} for it in (1, 2)]
    run = write_run(tmp_path / "r", sync_timings(), metrics)
    out = inspect_run(run)
    assert out.exists() and out.stat().st_size > 10_000
