"""The RL loop end to end with the real components (Ray, Megatron-core, vLLM): driven through the CLI the way a
user runs it where the test stops, kills or resumes the run's processes, else through the Python API in the test's
process on the session's pooled ranks and engines (what a run computes does not depend on who started its
processes: the stop test resumes CLI runs to the end of the pooled reference run). All runs join the test
session's Ray cluster."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rollout.engine_proc import pids_alive
from tests.integration.run_helpers import (ROOT, TIDE, assert_ends_as, resume_cut_back, resume_here, run_here,
                                          threads_cpus, tide)

pytestmark = pytest.mark.slow


# float32 engine and trainer log-probs of the same tokens: measured ~1e-7 apart (docs/models.md: at most 6.6e-7),
# 100x below the run's own bound of 1e-4, which exit 0 already implies
FP32_GAP = 1e-5


def _config(name: str, address: str, **over) -> dict:
    cfg = {
        "name": name, "seed": 3, "deterministic": True, "iterations": 4, "save_every": 2,
        "ray": {"address": address},
        "model": {"tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 128}},
        "task": {"name": "addition", "max_digits": 1},
        "trainer": {"loss": "kimi", "lr": 2e-3, "warmup_sft_steps": 2, "warmup_sft_batch": 32, "warmup_sft_lr": 3e-3},
        "rollout": {"prompts_per_iteration": 8, "n_samples": 4, "max_new_tokens": 4, "sync_mode": "reload",
                    "kv_cache_gb": 0.125, "probe_prompts": 4},
        "publish": {"shm_root": f"/dev/shm/tide-test-{os.getpid()}"},
    }
    for key, value in over.items():
        section, _, field = key.partition("__")
        if field:
            cfg.setdefault(section, {})[field] = value
        else:
            cfg[section] = value
    return cfg


def _write(tmp: Path, cfg: dict) -> Path:
    path = tmp / f"{cfg['name']}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# The reference run also carries a reference-policy KL term, a warm-up + cosine learning-rate schedule and an eval
# phase every 2 iterations, so that the resume test covers their state (the frozen reference in the checkpoint,
# the rate of each iteration, the eval seeds).
REF = {"trainer__kl": {"coef": 0.05, "estimator": "k3"},
       "trainer__lr_schedule": {"warmup_iterations": 1, "decay": "cosine", "min_lr": 2e-4},
       "eval": {"every": 2, "prompts": 8, "n_samples": 3}}


@pytest.fixture(scope="module")
def reference_run(built_once, address, worker_pools):
    """An uninterrupted 4-iteration run in reload mode (shared by the loop, resume and export tests, which only
    read it; run once for both test workers)."""

    def run(tmp: Path) -> None:
        run_here(worker_pools, _write(tmp, _config("ref", address, **REF)), run_dir=tmp / "run")

    return built_once("reference_run", run) / "run"


def test_loop_records_every_phase_and_keeps_vllm_on_trainer_weights(reference_run):
    metrics = _metrics(reference_run)
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        # exit 0 already means gap <= the bound: what it is made of is checked instead, the trainer's and vLLM's
        # own float32 log-probs, ~1e-7 apart (not 0: an old_log_probs that copied the rollout's would give 0)
        assert 0 < m["logprob_gap"] <= FP32_GAP, m
        assert 0.0 <= m["reward_mean"] <= 1.0
    timings = [json.loads(l) for l in (reference_run / "timings.jsonl").read_text().splitlines()]
    phases = {(t["iteration"], t["phase"]) for t in timings}
    for it in range(1, 5):
        for phase in ("rollout", "reward", "reference", "train", "publish", "sync"):
            assert (it, phase) in phases
    # the reference is the policy RL starts from: no divergence in iteration 1's only optimizer step
    assert metrics[0]["kl_ref"] == pytest.approx(0.0, abs=1e-9)
    assert metrics[-1]["kl_ref"] > 1e-6 and all(m["kl_ref_mean"] >= 0 for m in metrics)
    # the rates the ranks' optimizers stepped with: warm-up 1/1, then cosine from 2e-3 at progress 0, 1/3, 2/3
    # (min_lr is reached one iteration after the last, which still updates)
    assert [m["lr"] for m in metrics] == pytest.approx([2e-3, 2e-3, 2e-4 + 1.8e-3 * 0.75, 2e-4 + 1.8e-3 * 0.25])
    assert (2, "checkpoint") in phases and (4, "checkpoint") in phases
    # eval every 2 iterations: greedy pass@1, unbiased pass@1 and pass@3 from 3 samples, mean reward
    assert {it for it, phase in phases if phase == "eval"} == {2, 4}
    for m in metrics:
        keys = {"eval/pass@1", "eval/sampled_pass@1", "eval/pass@3", "eval/reward_mean"}
        assert keys <= m.keys() if m["iteration"] % 2 == 0 else not keys & m.keys()
        if m["iteration"] % 2 == 0:
            # rewards are 0 or 1: the unbiased pass@1 of n samples is their mean reward (pass@k's counts)
            assert m["eval/sampled_pass@1"] == pytest.approx(m["eval/reward_mean"], abs=1e-9)
            assert 0 <= m["eval/pass@1"] <= 1 and 0 <= m["eval/pass@3"] <= 1
    assert (reference_run / "tb").is_dir() and any((reference_run / "tb").iterdir())
    assert all(t["bytes"] > 0 for t in timings if t["phase"] in ("publish", "sync"))
    for t in (t for t in timings if t["phase"] == "sync"):  # the engine's checksums and its load, within the phase
        assert set(t["parts"]) == {"verify", "load"} and 0 < sum(t["parts"].values()) <= t["seconds"], t
    for m in metrics:  # what a TRL / veRL user reads (kimi's loss: no clipping, so no clip fractions)
        assert m["entropy"] > 0 and m["logp_mean"] < 0 and m["tokens"] > 0 and m["prompt_tokens"] > 0, m
        assert 0 <= m["zero_std_groups"] <= 1 and m["reward_std"] >= 0 and 0 <= m["clipped_ratio"] <= 1, m
        assert 1 <= m["completion_len_min"] <= m["completion_len"] <= m["completion_len_max"] <= 4, m
        assert m["optimizer_steps"] == 1 and "clip_fraction_low" not in m
    samples = [json.loads(line) for line in (reference_run / "samples.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in samples] == [it for it in range(1, 5) for _ in range(4)]  # logging.samples: 4
    assert all(r["prompt"].endswith("=") and isinstance(r["completion"], str) for r in samples)
    assert json.loads((reference_run / "status.json").read_text())["state"] == "finished"
    proc = tide("inspect", reference_run, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rollout" in proc.stdout and "share" in proc.stdout and "status: finished" in proc.stdout
    assert (reference_run / "timings.png").stat().st_size > 10_000


def _wait_for_iteration(proc: subprocess.Popen, run_dir: Path, iteration: int) -> dict:
    """Poll status.json until the run starts `iteration` (its previous iterations are recorded by then); the
    status read. Waiting for one exact phase raced: on a fast machine a phase can end between two polls."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            s = json.loads((run_dir / "status.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            s = {}
        if s.get("iteration", 0) >= iteration:
            return s
        assert proc.poll() is None, f"run ended before iteration {iteration}"
        time.sleep(0.01)
    pytest.fail(f"run never reached iteration {iteration}")


def test_stopped_anywhere_then_resumed_matches_uninterrupted(reference_run, tmp_path, address, worker_pools):
    """A scheduler's SIGTERM unwinds like Ctrl-C (exit 130, engines stopped, nothing left in /dev/shm; not Ray's
    native abort, exit 134, no cleanup); stopped in iteration 1, the run resumes from the warm start's checkpoint
    (iteration 0) without warming up again. The resumed run is then SIGKILLed with its whole process group (no
    cleanup at all) and resumed again, from its iteration-2 checkpoint: the run ends with the metrics, samples and
    parameters of the uninterrupted reference run, no iteration recorded twice."""
    cfg = _write(tmp_path, _config("ref", address, **REF))  # same name and seed: same problems and weights
    run_dir, shm = tmp_path / "run", Path(_config("ref", address)["publish"]["shm_root"])
    with open(tmp_path / "stderr", "w") as stderr:  # a file, not a pipe nobody reads while the run goes on
        proc = subprocess.Popen([*TIDE, "run", str(cfg), "--run-dir", str(run_dir)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=stderr)
    s = _wait_for_iteration(proc, run_dir, 1)  # the warm start's checkpoint is complete by then
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == 130 and "interrupted; `tide resume` continues" in err, err[-4000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["error"]) == ("failed", "interrupted (Ctrl-C or SIGTERM)")
    # ended: a zombie its parent (the raylet) has not reaped yet runs nothing (os.kill(pid, 0) still finds it)
    assert pids_alive(s["engine_pids"]) == []
    assert not shm.exists() or not any(shm.iterdir())
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["iter_0000000"]  # what `tide resume` continues

    # Resumed from iteration 0, killed at the first sign of iteration 4: whatever the kill point, from there to
    # the end of the run (its checkpoint, engine shutdown), the next resume must redo the lost iterations.
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen([*TIDE, "resume", str(run_dir)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=stderr, start_new_session=True)
    _wait_for_iteration(proc, run_dir, 4)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (run_dir / "final.json").exists(), "run ended before it was killed"
    err = (tmp_path / "stderr").read_text()
    assert "resumed from iteration 0" in err and "supervised warm start" not in err, err[-4000:]
    from orchestrator.records.rundir import RunDir

    assert RunDir(run_dir).status()["state"] == "failed"  # status.json says running; its driver is gone
    recorded = [m["iteration"] for m in _metrics(run_dir)]
    assert recorded[:3] == [1, 2, 3] and recorded == list(range(1, len(recorded) + 1)), recorded
    resume_here(worker_pools, run_dir)  # the computation to its end: in this process, on the pooled workers
    assert_ends_as(run_dir, reference_run)


# max_staleness 1: the next batch drawn while an iteration trains; the trainer recomputes pi_old (TIS). An entropy
# bonus moves the policy every step even where the tiny model earns no reward, so that staleness shows.
ASYNC = {"rollout__max_staleness": 1, "rollout__mismatch_correction": "tis", "trainer__entropy_coef": 0.05,
         "placement__mode": "disaggregated"}


def test_one_step_overlap_keeps_its_staleness_and_resumes_exactly(tmp_path, address, worker_pools):
    """rollout.max_staleness 1: every batch after the first was sampled by the policy one update before the one
    that trains on it, never older, and matches that policy's log-probs (the trainer's snapshot of it); a
    run SIGKILLed after its iteration-2 checkpoint, while batch 4 is drawn ahead, resumes (batch 3 from the
    checkpoint) to the uninterrupted run's metrics, samples and parameters. Disaggregated: the engines run on the
    first half of the cores, the trainer ranks on the others, every thread of theirs."""
    from orchestrator.workers.placement import split_cpus
    from orchestrator.records.rundir import read_jsonl
    from rollout.config import RolloutConfig

    cfg = _write(tmp_path, _config("async", address, **ASYNC))
    run_here(worker_pools, cfg, run_dir=tmp_path / "whole")
    metrics = _metrics(tmp_path / "whole")
    assert [(m["staleness"], m["behaviour_version"]) for m in metrics] == [(0, 0), (1, 0), (1, 1), (1, 2)]
    # every batch against the policy that sampled it (a stale one on the trainer's snapshot of that policy)
    assert all(0 < m["logprob_gap"] <= FP32_GAP for m in metrics), metrics
    assert "stale_logprob_gap" not in metrics[0] and "probe_gap" not in metrics[0]  # one engine: no probe
    # a stale batch's pi_old / pi_behaviour spans an update (far above the float32 gap), and TIS weighs it
    assert all(m["stale_logprob_gap"] > 100 * FP32_GAP for m in metrics[1:]), metrics
    assert all(m["is_weight_mean"] != 1.0 for m in metrics[1:]), metrics
    timings = read_jsonl(tmp_path / "whole" / "timings.jsonl")
    ahead = [t for t in timings if t["phase"] == "rollout_ahead"]
    assert [t["iteration"] for t in ahead] == [2, 3, 4] and all(t["seconds"] > 0 for t in ahead)
    # batch 2 checked at the start of iteration 2, while batch 3 is drawn and before iteration 2 trains; batch 3
    # before iteration 2's checkpoint (the snapshot it is checked on is not saved); batch 4 as batch 2
    checks = [t for t in timings if t["phase"] == "ahead_check"]
    assert [t["iteration"] for t in checks] == [2, 2, 4]
    start = {(t["iteration"], t["phase"]): t["start"] for t in timings}
    for check, it in ((checks[0], 2), (checks[2], 4)):
        assert start[(it, "train")] > check["start"], check
        if it < 4:  # while the next batch was being drawn
            ahead_rec = next(t for t in ahead if t["iteration"] == it + 1)
            assert check["start"] < ahead_rec["start"] + ahead_rec["seconds"], (check, ahead_rec)
    assert start[(2, "checkpoint")] > checks[1]["start"] > start[(2, "train")]

    run_dir = tmp_path / "killed"
    proc = subprocess.Popen([*TIDE, "run", str(cfg), "--run-dir", str(run_dir)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    status = _wait_for_iteration(proc, run_dir, 3)  # the iteration-2 checkpoint, holding batch 3, is complete then
    engine_cpus, trainer_cpus = split_cpus(sorted(os.sched_getaffinity(0)), None, RolloutConfig())
    assert [threads_cpus(pid) for pid in status["engine_pids"]] == [{engine_cpus}]
    assert [threads_cpus(pid) for pid in status["trainer_pids"]] == [{trainer_cpus}]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert (run_dir / "checkpoints" / "iter_0000002" / "drawn_ahead.pkl").is_file()
    resume_here(worker_pools, run_dir)
    assert_ends_as(run_dir, tmp_path / "whole")


# max_staleness 2 with partial rollouts: a generation gets 2 of its 4 tokens per sampling and is continued in the
# next one, under the weights the engines serve then; grpo's pi_old interpolated per token by its version in the
# train step
PARTIAL = {**ASYNC, "rollout__max_staleness": 2, "rollout__partial_rollout": True, "rollout__partial_rollout_tokens": 2,
           "trainer__loss": "grpo", "rollout__proximal": "loglinear"}


def test_partial_rollouts_span_versions_within_the_bound_and_resume_exactly(tmp_path, address, worker_pools):
    """rollout.partial_rollout with max_staleness 2: generations set aside after 2 tokens are continued in the next
    sampling by the next policy, so trained samples hold tokens of two versions; every sampling's tokens match the
    log-probs of the policy that sampled them (the trainer's snapshot of it), no token is more than 2 updates old
    when trained (2 reached), and the run resumed from its iteration-2 checkpoint (which holds batch 3 and the
    generations it set aside) ends with the uninterrupted run's metrics, samples and parameters. pi_old is
    interpolated in the train step (rollout.proximal loglinear): no recomputation, stale tokens weighed."""
    from orchestrator.records.rundir import read_jsonl

    cfg = _write(tmp_path, _config("partial", address, **PARTIAL))
    run_here(worker_pools, cfg, run_dir=tmp_path / "whole")
    metrics = _metrics(tmp_path / "whole")
    assert all(0 < m["logprob_gap"] <= FP32_GAP for m in metrics), metrics
    assert [m["staleness_token_max"] for m in metrics] == [0, 1, 2, 2], metrics
    assert all(m["stale_masked_tokens"] == 0 for m in metrics)
    # iteration 3's batch: groups set aside by sampling 2 (policy 0) and ended in sampling 3 (policy 1)
    assert metrics[2]["partial_share"] > 0 and metrics[2]["staleness_tokens_1"] > 0
    assert metrics[2]["staleness_tokens_2"] > 0
    assert any(m["partial_groups_set_aside"] > 0 for m in metrics[:3]) and metrics[3]["partial_groups_set_aside"] == 0
    # each optimizer step of the 4 gets a sample; every generation trained once: as many as were opened
    assert all(m["samples"] >= 4 for m in metrics) and sum(m["samples"] for m in metrics) == 4 * 8 * 4
    assert not any(t["phase"] == "old_logprobs" for t in read_jsonl(tmp_path / "whole" / "timings.jsonl"))
    assert all(m["is_weight_mean"] != 1.0 for m in metrics[1:]), metrics

    # cut back to the iteration-2 checkpoint (which holds the batch drawn ahead), as a run killed during iteration
    # 3 or 4 is; killing the driver mid-run: the stop and one-step-overlap tests
    assert (tmp_path / "whole" / "checkpoints" / "iter_0000002" / "drawn_ahead.pkl").is_file()
    resume_cut_back(tmp_path / "whole", tmp_path / "cut", 2, pools=worker_pools)
    assert_ends_as(tmp_path / "cut", tmp_path / "whole")


# rollout.weight_update in_flight (PipelineRL): the batch drawn ahead takes the weights of the train step it
# overlaps between its 2nd and 3rd decode steps, waiting for them there (in_flight_step: a fixed schedule)
IN_FLIGHT = {**ASYNC, "rollout__weight_update": "in_flight", "rollout__in_flight_step": 2}


def test_weights_taken_in_flight_keep_each_tokens_version_and_resume_exactly(tmp_path, address, worker_pools):
    """Each batch after the first starts on the policy one update before the one that trains it and takes that
    policy in flight: its first 2 tokens per generation are one update old, the others are sampled by the
    training policy itself, and each group matches its own policy's log-probs (the snapshot's, and the
    trainer's current ones: the KV recomputed at the switch). Drained only for a checkpoint; the run resumed
    from its iteration-2 checkpoint ends with the uninterrupted run's metrics, samples and parameters."""
    from orchestrator.records.rundir import read_jsonl

    cfg = _write(tmp_path, _config("in_flight", address, **IN_FLIGHT))
    run_here(worker_pools, cfg, run_dir=tmp_path / "whole")
    metrics = _metrics(tmp_path / "whole")
    assert [(m["staleness"], m["behaviour_version"]) for m in metrics] == [(0, 0), (1, 0), (1, 1), (1, 2)]
    assert "staleness_tokens_0" not in metrics[0]
    for m in metrics[1:]:
        # at most 4 tokens, 2 before the switch: at most half are fresh; more than a quarter, or it came later
        assert m["staleness_token_max"] == 1 and 0.25 < m["staleness_tokens_0"] <= 0.5, m
        assert 0 < m["logprob_gap"] <= FP32_GAP and 0 < m["in_flight_logprob_gap"] <= FP32_GAP, m
        assert m["stale_logprob_gap"] > 100 * FP32_GAP and m["stale_masked_tokens"] == 0, m
    timings = read_jsonl(tmp_path / "whole" / "timings.jsonl")
    assert [t["iteration"] for t in timings if t["phase"] == "drain"] == [2, 4]  # the checkpoints' only

    # cut back to the iteration-2 checkpoint (which holds the batch drawn ahead), as a run killed during iteration
    # 3 or 4 is; killing the driver mid-run: the stop and one-step-overlap tests
    assert (tmp_path / "whole" / "checkpoints" / "iter_0000002" / "drawn_ahead.pkl").is_file()
    resume_cut_back(tmp_path / "whole", tmp_path / "cut", 2, pools=worker_pools)
    assert_ends_as(tmp_path / "cut", tmp_path / "whole")


# bfloat16 with truncated importance sampling: Megatron's mixed-precision optimizer on CPU (bf16 parameters, fp32
# main parameters and Adam state in the checkpoint), vLLM's bf16 path, the default bf16 gap bound.
BF16 = {"model__dtype": "bfloat16", "rollout__mismatch_correction": "tis"}


def test_finished_run_extends_exactly(tmp_path, address, worker_pools):
    """`tide resume RUN --iterations N` on a finished run continues as if the run had been started with N; here
    in bfloat16 with TIS, whose weights appear in the metrics."""
    from rollout.config import DEFAULT_LOGPROB_GAP

    short, full = tmp_path / "short", tmp_path / "full"
    run_here(worker_pools, _write(tmp_path, _config("ext", address, iterations=2, **BF16)), run_dir=short)
    resume_here(worker_pools, short, iterations=3)
    (tmp_path / "long").mkdir()
    run_here(worker_pools, _write(tmp_path / "long", _config("ext", address, iterations=3, **BF16)), run_dir=full)
    metrics = _metrics(short)
    assert [m["iteration"] for m in metrics] == [1, 2, 3]
    assert (short / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()
    assert json.loads((short / "final.json").read_text()) == json.loads((full / "final.json").read_text())
    for m in metrics:
        assert 0 < m["logprob_gap"] <= DEFAULT_LOGPROB_GAP["bfloat16"], m
        # the weights are exp(trainer - vLLM) of the same tokens the gap averages |trainer - vLLM| over (the
        # whole batch): |mean w - 1| <= mean |exp(d) - 1| <= e^max|d| x gap, and not exactly 1 (bfloat16 kernels
        # differ); the cap 2 is never reached at these gaps
        assert 0 < abs(m["is_weight_mean"] - 1) <= 3 * m["logprob_gap"], m
        assert m["is_truncated_frac"] == 0 and 1 < m["is_ratio_max"] < 2 and 0.5 < m["is_ratio_min"] < 1, m
    timings = [json.loads(l) for l in (short / "timings.jsonl").read_text().splitlines()]
    assert {t["iteration"] for t in timings if t["phase"] == "old_logprobs"} == {1, 2, 3}
    refused = tide("resume", short, "--iterations", 3, timeout=120)
    assert refused.returncode == 2 and "already has a checkpoint at iteration 3" in refused.stderr


def test_tp2_trainer_feeds_two_rollout_nodes_through_mooncake(tmp_path, address, worker_pools):
    """TP=2 ranks publish TP shards; two rollout nodes pull them through the transfer engine, merge them and vLLM
    serves the trainer's weights. Also a user's workload: the chat-format dataset of configs/chat_dataset.yaml
    through the tiny model's chat template, generation ending at a stop string, scored by the `math` built-in
    and a user function (configs/chat_rewards.py)."""
    shm = f"/dev/shm/tide-test-nodes-{os.getpid()}"
    subprocess.run([sys.executable, "scripts/make_chat_dataset.py", "--out", str(tmp_path / "data"), "--train", "200",
                    "--eval", "20"], cwd=ROOT, check=True, capture_output=True)
    shipped = yaml.safe_load((ROOT / "configs" / "chat_dataset.yaml").read_text())
    cfg = _write(tmp_path, _config(
        "two_nodes", address, iterations=2, save_every=2, rollout__engines=2, rollout__stop=["\n"],
        rollout__max_prompt_tokens=128,
        transfer={"enabled": True, "rollout_shm_root": shm, "registry_name": f"tide_test_registry_{os.getpid()}"},
        task={**shipped["task"], "path": str(tmp_path / "data" / "train.jsonl"),
              "eval_path": str(tmp_path / "data" / "eval.jsonl")},
        rewards=[{**r, "fn": str(ROOT / "configs" / r["fn"]) if ".py:" in r["fn"] else r["fn"]}
                 for r in shipped["rewards"]],  # a file relative to the shipped config
        eval={"every": 2, "prompts": 8, "n_samples": 2},
        trainer={**_config("x", address)["trainer"], "parallel": {"tp": 2, "pp": 1, "ep": 1}},
        model={"tiny": {**_config("x", address)["model"]["tiny"], "num_kv_heads": 2},  # one key/value head per TP rank
               "chat_template": "auto", "system_prompt": shipped["model"]["system_prompt"]}))
    try:
        run_here(worker_pools, cfg, run_dir=tmp_path / "run")
        metrics = _metrics(tmp_path / "run")
        assert [m["iteration"] for m in metrics] == [1, 2]
        for m in metrics:
            assert 0 < m["logprob_gap"] <= FP32_GAP
            assert m["transfer_bytes"] > 0 and m["transfer_seconds"] > 0
            assert 0 <= m["reward/math"] <= 1 and 0 <= m["reward/answer_only"] <= 1
            assert m["excluded"] == 0  # `math` scores every sample; answer_only skips subtractions only
            assert m["prompts_skipped"] == 0 and m["prompts_truncated"] == 0
        assert "eval/pass@2" in metrics[1]
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_finished_run_holds_an_hf_model_and_export_rebuilds_it(reference_run, tmp_path, rollout_engine):
    """RUN_DIR/hf holds the weights vLLM served last; `tide export` rebuilds them from the Megatron checkpoint
    (no Ray, no vLLM), any kept iteration, and `--verify` finds transformers' logits on it within 1e-4 of the
    Megatron model's; transformers and vLLM load the export and agree on greedy tokens and their log-probs."""
    import ray
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ckpt_transfer.manifest import Manifest
    from rollout.tasks import AdditionTask

    newest, earlier = tmp_path / "it4", tmp_path / "it2"
    for args in ([newest, "--verify"], [earlier, "--iteration", 2]):
        proc = tide("export", reference_run, *args, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        if "--verify" in args:  # transformers' logits on the export against the Megatron model's, float32
            diff = re.search(r"max \|logit difference\| transformers vs Megatron (\S+),", proc.stdout)
            assert diff and float(diff.group(1)) <= 1e-4, proc.stdout
    refused = tide("export", reference_run, tmp_path / "x", "--iteration", 3, timeout=120)
    assert refused.returncode == 2 and "keeps no checkpoint of iteration 3 (kept: 2, 4)" in refused.stderr

    def tensors(d: Path) -> dict:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    served, exported, older = tensors(reference_run / "hf"), tensors(newest), tensors(earlier)
    assert served.keys() == exported.keys() and all(torch.equal(served[k], exported[k]) for k in served)
    assert any(not torch.equal(served[k], older[k]) for k in served)

    tok = AutoTokenizer.from_pretrained(newest)
    model = AutoModelForCausalLM.from_pretrained(newest, dtype=torch.float32).eval()
    problems = AdditionTask(1).problems(0, 0, 4)
    ray.get(rollout_engine.sync.remote(Manifest.load(newest), "reload"), timeout=400)
    samples = ray.get(rollout_engine.generate.remote(problems, 1, 4, 0.0, 0), timeout=400)
    for p, s in zip(problems, samples):
        ids = tok(p.prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            greedy = model.generate(ids, do_sample=False, max_new_tokens=4, pad_token_id=tok.eos_token_id)
        assert greedy[0, ids.shape[1]:].tolist()[:len(s.completion_ids)] == s.completion_ids
        full = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            logp = model(full).logits[0, :-1].log_softmax(-1).gather(-1, full[0, 1:, None]).squeeze(-1)
        ours = logp[len(s.prompt_ids) - 1:].tolist()
        vllm = ray.get(rollout_engine.score_sequences.remote([s.prompt_ids], [s.completion_ids]), timeout=400)[0]
        assert max(abs(a - b) for a, b in zip(ours, vllm)) <= 1e-4


def test_a_pooled_run_that_fails_hands_its_workers_back(tmp_path, address, worker_pools):
    """A run on the pools that stops on an error after start-up (here its reward function raising in the first
    reward phase) raises it, says so in status.json and hands its rank and engine processes back stopped: the pools
    hold at least as many idle processes as before, and the next run on them finishes."""
    (tmp_path / "boom.py").write_text("def boom(completions, **kwargs):\n    raise ValueError('boom')\n")
    idle = (len(worker_pools.ranks._idle), len(worker_pools.engines._idle))
    cfg = _config("fails", address, iterations=1, rewards=[{"fn": f"{tmp_path / 'boom.py'}:boom"}])
    with pytest.raises(Exception, match="boom"):
        run_here(worker_pools, _write(tmp_path, cfg), run_dir=tmp_path / "failed")
    assert json.loads((tmp_path / "failed" / "status.json").read_text())["state"] == "failed"
    assert (len(worker_pools.ranks._idle), len(worker_pools.engines._idle)) >= (max(idle[0], 1), max(idle[1], 1))
    fine = {k: v for k, v in cfg.items() if k != "rewards"}
    run_here(worker_pools, _write(tmp_path, fine), run_dir=tmp_path / "next")
    assert json.loads((tmp_path / "next" / "status.json").read_text())["state"] == "finished"
