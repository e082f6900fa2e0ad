import json

from orchestrator.records.rundir import RunDir


def test_phase_records_and_truncate(tmp_path):
    run = RunDir(tmp_path / "r")
    for it in (1, 2, 3):
        with run.phase(it, "train") as rec:
            rec["bytes"] = 10 * it
        run.log_metrics({"iteration": it, "reward_mean": it / 10})
    assert [r["bytes"] for r in run.timings()] == [10, 20, 30]
    run.truncate_after(2)
    assert [m["iteration"] for m in run.metrics()] == [1, 2]
    assert [t["iteration"] for t in run.timings()] == [1, 2]


def test_torn_last_line_is_ignored(tmp_path):
    run = RunDir(tmp_path / "r")
    run.log_metrics({"iteration": 1})
    with open(run.metrics_file, "a") as f:
        f.write('{"iteration": 2, "rew')
    assert run.metrics() == [{"iteration": 1}]


def test_checkpoint_is_complete_only_after_rename(tmp_path):
    run = RunDir(tmp_path / "r")
    try:
        with run.writing_checkpoint(4, {"iteration": 4}) as tmp:
            (tmp / "weights").write_text("x")
            raise RuntimeError("killed mid-save")
    except RuntimeError:
        pass
    assert run.latest_checkpoint() is None
    with run.writing_checkpoint(4, {"iteration": 4}) as tmp:
        (tmp / "weights").write_text("x")
    with run.writing_checkpoint(8, {"iteration": 8}):
        pass
    assert run.latest_checkpoint().name == "iter_0000008"
    assert run.read_run_state(run.latest_checkpoint()) == {"iteration": 8}
    run.prune_checkpoints(1)
    assert [p.name for p in run.checkpoints.iterdir()] == ["iter_0000008"]


def test_logprob_gap_guard_names_the_limit():
    import math

    import pytest

    from orchestrator.iteration.logprob_check import LogprobGapError, check_logprob_gap

    check_logprob_gap(3, 5e-5, 1e-4)
    with pytest.raises(LogprobGapError, match=r"iteration 3: .* differ by 0.002 .*max_logprob_gap = 0.0001"):
        check_logprob_gap(3, 2e-3, 1e-4)
    with pytest.raises(LogprobGapError):
        check_logprob_gap(3, math.nan, 1e-4)
    from rollout.config import RolloutConfig

    origin = RolloutConfig().logprob_gap_origin("bfloat16")
    with pytest.raises(LogprobGapError, match=r"differ by 0.05 .*\(rollout.max_logprob_gap = 0.03, the default for "
                                              r"model.dtype bfloat16\)"):
        check_logprob_gap(3, 0.05, 0.03, origin=origin)


def _scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_metrics_and_phase_times_reach_tensorboard(tmp_path):
    run = RunDir(tmp_path / "r")
    for it in (1, 2):
        with run.phase(it, "rollout"):
            pass
        run.log_metrics({"iteration": it, "reward_mean": 0.25 * it, "note": "text", "nan": float("nan")})
    run.close()
    got = _scalars(tmp_path / "r" / "tb")
    assert got["reward_mean"] == [(1, 0.25), (2, 0.5)]
    assert [step for step, _ in got["time/rollout"]] == [1, 2] and all(v >= 0 for _, v in got["time/rollout"])
    assert "note" not in got and "nan" not in got and "iteration" not in got


def test_resumed_run_does_not_draw_redone_iterations_twice(tmp_path):
    run = RunDir(tmp_path / "r")
    for it in (1, 2, 3):
        run.log_metrics({"iteration": it, "reward_mean": float(it)})
    run.close()
    resumed = RunDir(tmp_path / "r")
    resumed.truncate_after(1)  # the checkpoint was at iteration 1: 2 and 3 are run again
    for it in (2, 3):
        resumed.log_metrics({"iteration": it, "reward_mean": 10.0 * it})
    resumed.close()
    assert _scalars(tmp_path / "r" / "tb")["reward_mean"] == [(1, 1.0), (2, 20.0), (3, 30.0)]


def test_samples_reach_jsonl_and_tensorboard_text_and_a_resume_redoes_them(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = RunDir(tmp_path / "r")
    for it in (1, 2):
        run.log_samples(it, [{"iteration": it, "prompt": "1+1=", "completion": f"{it} | x", "reward": 0.5,
                              "completion_tokens": 2, "finish_reason": "stop"}])
    run.close()
    resumed = RunDir(tmp_path / "r")
    resumed.truncate_after(1)
    resumed.log_samples(2, [{"iteration": 2, "prompt": "2+2=", "completion": "4", "reward": 1.0,
                             "completion_tokens": 1, "finish_reason": "stop"}])
    resumed.close()
    assert [(r["iteration"], r["completion"]) for r in resumed.samples()] == [(1, "1 | x"), (2, "4")]
    acc = EventAccumulator(str(tmp_path / "r" / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("samples/text_summary")}
    assert "1 \\| x" in texts[1] and "| prompt | completion | reward |" in texts[1]  # a markdown table, | escaped


def test_status_says_how_the_run_ended(tmp_path):
    import os
    import subprocess
    import sys

    run = RunDir(tmp_path / "r")
    run.set_status(iteration=3, phase="train")
    assert run.status()["state"] == "running"
    run.end_status(ValueError("reward 'x' raised KeyError"))
    status = run.status()
    assert (status["state"], status["phase"], status["error"]) == ("failed", "train",
                                                                   "ValueError: reward 'x' raised KeyError")
    run.end_status(KeyboardInterrupt())
    assert run.status()["error"] == "interrupted (Ctrl-C or SIGTERM)"
    run.end_status()
    assert (run.status()["state"], run.status()["phase"]) == ("finished", "finished")
    # a driver that died without a word (SIGKILL): its status still says running, its pid is gone
    code = ("import sys; from orchestrator.records.rundir import RunDir; RunDir(sys.argv[1]).set_status(iteration=2, "
            "phase='rollout')")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "k")], check=True, cwd=os.getcwd())
    status = RunDir(tmp_path / "k").status()
    assert status["state"] == "failed" and "ended without recording how" in status["error"]
    assert status["phase"] == "rollout"



def test_a_run_stopped_by_its_input_leaves_no_directory(tmp_path):
    """A data error found at start-up (exit 2, through the CLI) leaves nothing behind when the run made the
    directory."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"name": "bad", "iterations": 1,
                                      "task": {"name": "dataset", "path": "rows.jsonl"}}))
    proc = subprocess.run([sys.executable, "-m", "orchestrator.run.cli", "run", str(config), "--run-dir",
                           str(tmp_path / "new")], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2 and "row 2" in proc.stderr and "'answer'" in proc.stderr, proc.stderr
    assert not (tmp_path / "new").exists()


def test_a_broken_run_says_why_and_a_directory_it_did_not_make_stays(tmp_path, monkeypatch):
    """How `tide run` / `tide resume` end a run (orchestrator.run.api.execute): a failure after start-up leaves
    status.json `failed` with the error and the phase it happened in; an input error in a directory that existed
    before leaves that directory, saying so; a finished run reads `finished`."""
    import pytest

    from orchestrator.run import api
    from rollout.tasks import TaskDataError

    def broken(cfg, run, resume, pools=None):
        run.set_status(iteration=1, phase="reward")
        raise RuntimeError("reward 'boom' (my_rewards.py:boom) raised ValueError: no such column")

    monkeypatch.setattr(api, "drive", broken)
    run = RunDir(tmp_path / "broken")
    with pytest.raises(RuntimeError):
        api.execute(None, run, resume=False)
    status = json.loads((tmp_path / "broken" / "status.json").read_text())
    assert (status["state"], status["iteration"], status["phase"]) == ("failed", 1, "reward")
    assert status["error"] == "RuntimeError: reward 'boom' (my_rewards.py:boom) raised ValueError: no such column"

    def bad_row(cfg, run, resume, pools=None):
        raise TaskDataError("rows.jsonl: row 2: field 'answer' is missing or null")

    monkeypatch.setattr(api, "drive", bad_row)
    (tmp_path / "old").mkdir()
    with pytest.raises(TaskDataError):
        api.execute(None, RunDir(tmp_path / "old"), resume=True)
    assert json.loads((tmp_path / "old" / "status.json").read_text())["state"] == "failed"

    monkeypatch.setattr(api, "drive", lambda cfg, run, resume, pools=None: None)
    api.execute(None, RunDir(tmp_path / "fine"), resume=False)
    assert json.loads((tmp_path / "fine" / "status.json").read_text())["state"] == "finished"


def test_idle_shares_count_each_roles_overlapping_phases_once():
    import pytest

    from orchestrator.run.wall_time import idle_shares

    def rec(it, phase, start, seconds):
        return {"iteration": it, "phase": phase, "start": start, "seconds": seconds}

    timings = [rec(0, "warmup", 0, 5), rec(1, "rollout", 5, 2), rec(1, "train", 7, 3),  # iteration 1 ends at 10
               # iteration 2 (10-20): the batch of iteration 3 sampled ahead from 11 to 15, during train and publish
               rec(2, "rollout", 10, 0.5), rec(2, "reward", 10.5, 0.5), rec(2, "train", 11, 5),
               rec(2, "publish", 16, 1), rec(3, "rollout_ahead", 11, 4), rec(2, "drain", 17, 0), rec(2, "sync", 17, 2),
               rec(2, "probe", 19, 1),
               # iteration 3 (20-30): its batch was ready; the engines also sampled from 20 to 21 (overlapping)
               rec(3, "rollout", 20, 1), rec(3, "train", 21, 6), rec(3, "sync", 27, 3),
               rec(3, "rollout_ahead", 20.5, 0.2)]
    # engines busy: 10-10.5, 11-15, 17-20, 20-21, 27-30 = 0.5 + 4 + 3 + 1 + 3 = 11.5 of 20; trainer: 11-17, 21-27 = 12
    assert idle_shares(timings) == {"engines": pytest.approx(1 - 11.5 / 20), "trainer": pytest.approx(1 - 12 / 20)}
    assert idle_shares(timings[:3]) is None
