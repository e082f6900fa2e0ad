"""Served reward models (`models:`, orchestrator/workers/served_models.py; rollout/reward_model.py): scores equal
to the model's own forward pass on each conversation alone, normalisation computed by hand, replicas replaced when they
die, timeouts and refusals naming the model, and the config's checks."""
from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from orchestrator.config.schema import ConfigError, parse_config
from orchestrator.rewards.normalize import normalized


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The session's tiny Qwen2 with a one-label score head (random: scores are compared, not judged)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("rm") / "rm"
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1, dtype=torch.float32)
    model.score.weight.data.normal_(0, 1.0)  # scores far enough apart that an order or padding error shows
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


PROMPTS = ["3+4=", "9+9=", [{"role": "user", "content": "1+1="}], "0+5="]
COMPLETIONS = ["7", "18 and more text", "2", ""]


def _own_forward(rm_dir: Path) -> list[float]:
    """transformers' forward on each conversation alone (no padding), rendered with the tokenizer's template."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    out = []
    for p, c in zip(PROMPTS, COMPLETIONS):
        messages = p if isinstance(p, list) else [{"role": "user", "content": p}]
        ids = tok.apply_chat_template(messages + [{"role": "assistant", "content": c}], tokenize=True,
                                      return_dict=True, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


def test_normalisation_by_hand():
    values, groups = [1.0, 3.0, 5.0, None, 5.0, 2.0], [0, 0, 1, 1, 1, 2]
    assert normalized(values, groups, "none") == values
    # group 0: mean 2, std 1; group 1: both 5, no spread; group 2: one value
    assert normalized(values, groups, "group") == [-1.0, 1.0, 0.0, None, 0.0, 0.0]
    # batch: mean 16/5 = 3.2, population variance (4.84 + 0.04 + 3.24 + 3.24 + 1.44) / 5 = 2.56, std 1.6
    got = normalized(values, groups, "batch")
    want = [(1 - 3.2) / 1.6, (3 - 3.2) / 1.6, 1.8 / 1.6, None, 1.8 / 1.6, (2 - 3.2) / 1.6]
    assert got[3] is None and all(abs(a - b) < 1e-12 for a, b in zip(got[:3] + got[4:], want[:3] + want[4:]))


def test_scores_are_the_models_own_forward_on_each_conversation(rm_dir):
    from rollout.reward_model import RewardModel

    model = RewardModel("rm", str(rm_dir), batch_size=3)  # a batch of three padded to its longest, then one
    got, want = model.score(PROMPTS, COMPLETIONS), _own_forward(rm_dir)
    assert len(set(round(w, 3) for w in want)) == len(want)  # distinct: an order error would show
    assert all(abs(g - w) < 1e-5 for g, w in zip(got, want)), (got, want)


def test_a_conversation_longer_than_the_context_is_refused_not_truncated(rm_dir):
    from rollout.reward_model import RewardModel, RewardModelError

    model = RewardModel("rm", str(rm_dir))
    with pytest.raises(RewardModelError, match=r"reward model 'rm': 1 conversation\(s\) longer than its context"):
        model.score(["1+1="], ["9" * (model.context + 10)])


def test_a_directory_without_a_model_is_named(tmp_path):
    from rollout.reward_model import RewardModel, RewardModelError

    with pytest.raises(RewardModelError, match=re.escape(f"reward model 'rm': {tmp_path} holds no config.json")):
        RewardModel("rm", str(tmp_path))


def _base(rm_dir, **extra) -> dict:
    return {"name": "t", "iterations": 1, "models": {"rm": {"path": str(rm_dir)}},
            "rewards": [{"model": "rm"}], **extra}


def test_config_checks_the_models_and_the_rewards_naming_them(rm_dir, tmp_path):
    cfg = parse_config(_base(rm_dir, rewards=[{"model": "rm", "normalize": "group"}, {"fn": "exact", "weight": 0}]))
    assert cfg.models["rm"].path == str(rm_dir) and cfg.rewards[0].label == "rm"
    cases = [
        ({"rewards": [{"model": "judge"}]}, "rewards: model 'judge' is not served: the `models:` section serves rm"),
        ({"rewards": [{"fn": "exact"}]}, "models: 'rm' is served but no reward uses it"),
        ({"rewards": [{"fn": "exact", "model": "rm"}]}, "give a reward either `fn`"),
        ({"rewards": [{"model": "rm", "style": "trl"}]}, "style and columns: are for functions"),
        ({"models": {"rm": {"path": str(tmp_path / "nowhere")}}}, "no such directory"),
        ({"models": {"rm": {"path": str(tmp_path)}}}, "holds no config.json"),
        ({"models": {"rm": {"path": str(rm_dir), "dtype": "float16"}}}, "dtype float16 on device cpu"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config(_base(rm_dir, **extra))
    with pytest.raises(ConfigError, match="scripts/train_reward_model.py"):
        parse_config(_base(rm_dir, models={"rm": {"path": str(tmp_path / "nowhere")}}))


def test_served_replicas_score_time_out_by_name_are_replaced_once_and_weigh_beside_a_function(ray_cluster, rm_dir):
    """One model served by two replicas (their start is most of this test's time, so the cases share them)."""
    from orchestrator.workers.served_models import ServedModels
    from orchestrator.rewards.served_config import ServedModelConfig

    served = ServedModels({"rm": ServedModelConfig(path=str(rm_dir), replicas=2, batch_size=2, max_replacements=1)})
    try:
        want = _own_forward(rm_dir)
        _weighed_beside_a_function(served, want)
        _timed_out(served)
        _replaced_once(served, want)
    finally:
        served.close()


def _weighed_beside_a_function(served, raw: list[float]) -> None:
    from orchestrator.rewards.functions import RewardFunctions, RewardSpec

    specs = [RewardSpec(model="rm", normalize="group", weight=2.0), RewardSpec(fn="exact", weight=0.5)]
    functions = RewardFunctions(specs)
    try:
        functions.attach_models(served)
        scored = functions.score(PROMPTS, COMPLETIONS, {"answer": ["7", "18", "2", "5"]}, groups=[0, 0, 1, 1])
    finally:
        functions.close()
    group_z = normalized(raw, [0, 0, 1, 1], "group")  # two per group: -1 and +1
    exact = [1.0, 0.0, 1.0, 0.0]
    want = [2.0 * z + 0.5 * e for z, e in zip(group_z, exact)]
    assert all(abs(g - w) < 1e-5 for g, w in zip(scored.rewards, want)), (scored.rewards, want)
    assert abs(scored.per_function["reward/rm/raw"] - sum(raw) / 4) < 1e-5
    assert scored.per_function["served/rm/scored"] == 4.0 and scored.parts["served/rm"] > 0
    assert not any("second" in k for k in scored.per_function)  # wall time is the timings', not a metric


def _timed_out(served) -> None:
    from orchestrator.workers.served_models import ServedModelError

    rm = served["rm"]
    configured, rm.cfg = rm.cfg, rm.cfg.model_copy(update={"timeout_s": 1e-4})
    try:
        with pytest.raises(ServedModelError, match=r"served model 'rm': replica \d \(pid \d+\) did not score its "
                                                   r"2 conversations within timeout_s = 0.0001"):
            rm.score(PROMPTS, COMPLETIONS)
    finally:
        rm.cfg = configured


def _replaced_once(served, want: list[float]) -> None:
    from orchestrator.workers.served_models import ServedModelError

    rm = served["rm"]
    assert len(set(rm.pids())) == 2 and os.getpid() not in rm.pids()
    got = rm.score(PROMPTS, COMPLETIONS)  # each replica scores half
    assert all(abs(g - w) < 1e-5 for g, w in zip(got, want)), (got, want)
    dead = rm.pids()[1]
    os.kill(dead, signal.SIGKILL)
    got = rm.score(PROMPTS, COMPLETIONS)  # the second replica's half is scored again by its replacement
    assert all(abs(g - w) < 1e-5 for g, w in zip(got, want)), (got, want)
    assert rm.replaced == 1 and dead not in rm.pids() and served.metrics()["served/rm/replaced"] == 1.0
    os.kill(rm.pids()[0], signal.SIGKILL)
    with pytest.raises(ServedModelError, match=r"served model 'rm': replica 0 \(pid \d+\) died, and "
                                               r"max_replacements = 1 were used"):
        rm.score(PROMPTS, COMPLETIONS)


def test_a_served_model_that_was_not_started_is_named():
    from orchestrator.rewards.functions import RewardFunctionError, RewardFunctions, RewardSpec

    functions = RewardFunctions([RewardSpec(model="rm")])
    try:
        with pytest.raises(RewardFunctionError, match="reward 'rm': served model 'rm' was not started"):
            functions.score(["1+1="], ["2"], {"answer": ["2"]})
    finally:
        functions.close()
