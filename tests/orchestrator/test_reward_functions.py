"""Pluggable rewards: built-ins against hand values, users' functions called TRL's way in a worker process,
None excluding a sample, and every way a function can fail named at start-up or at run time."""
import sys
import textwrap

import pytest

from orchestrator.reward_functions import RewardFunctionError, RewardFunctions, RewardSpec, load_reward_function

USER_MODULE = '''
import asyncio, time

def parity(prompts, completions, answer, op, **kw):
    """1 for an even answer on '+' problems, None (not applicable) on the others."""
    return [float(int(a) % 2 == 0) if o == "+" else None for a, o in zip(answer, op)]

async def slow_half(prompts, completions, **kw):
    await asyncio.sleep(0)
    return [0.5] * len(completions)

def no_kwargs(prompts, completions):
    return [0.0] * len(completions)

def boom(prompts, completions, **kw):
    raise KeyError("no such column")

def short(prompts, completions, **kw):
    return [1.0]

def nan(prompts, completions, **kw):
    return [float("nan")] * len(completions)

def hang(prompts, completions, **kw):
    time.sleep(60)
'''


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    d = tmp_path_factory.mktemp("user")
    (d / "my_rewards.py").write_text(textwrap.dedent(USER_MODULE))
    sys.path.insert(0, str(d))
    yield "my_rewards"
    sys.path.remove(str(d))


COLUMNS = {"answer": ["4", "3", "7"], "op": ["+", "+", "-"]}
COMPLETIONS = ["4", "the answer is \\boxed{3}", "6"]


def test_builtins_and_a_user_function_weighted(user_module):
    fns = RewardFunctions([RewardSpec(fn="numeric", weight=1.0), RewardSpec(fn=f"{user_module}:parity", weight=0.5)])
    try:
        got = fns.score(["p"] * 3, COMPLETIONS, COLUMNS)
    finally:
        fns.close()
    # numeric: 1, 1 (extracted), 0; parity: 1 (4 even), 0 (3 odd), None ('-')
    assert got.rewards == [1.5, 1.0, 0.0]
    assert got.per_function == {"reward/numeric": pytest.approx(2 / 3), "reward/parity": 0.5}


def test_a_sample_every_function_skips_has_no_reward(user_module):
    fns = RewardFunctions([RewardSpec(fn=f"{user_module}:parity")])
    try:
        assert fns.score(["p"] * 3, COMPLETIONS, COLUMNS).rewards == [1.0, 0.0, None]
    finally:
        fns.close()


def test_coroutine_functions_are_awaited(user_module):
    fns = RewardFunctions([RewardSpec(fn=f"{user_module}:slow_half")])
    try:
        assert fns.score(["p"] * 3, COMPLETIONS, COLUMNS).rewards == [0.5, 0.5, 0.5]
    finally:
        fns.close()


def test_math_verify_builtin_by_hand():
    fns = RewardFunctions([RewardSpec(fn="math")])
    try:
        got = fns.score(["p"] * 3, ["\\boxed{\\frac{1}{2}}", "0.5", "\\boxed{2}"], {"answer": ["0.5", "1/2", "3"]})
    finally:
        fns.close()
    assert got.rewards == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("fn,message", [
    ("nope", r"not a built-in \(exact, numeric, math, code, length\) nor 'package.module:function'"),
    ("no_such_module_xyz:f", r"cannot import no_such_module_xyz: ModuleNotFoundError"),
    ("{m}:missing", r"has no function 'missing'"),
    ("{m}:no_kwargs", r"must accept \(prompts, completions, \*\*columns\)"),
])
def test_start_up_errors_name_the_function(user_module, fn, message):
    with pytest.raises(RewardFunctionError, match=message):
        load_reward_function(fn.format(m=user_module))


@pytest.mark.parametrize("fn,message", [
    ("boom", r"reward 'boom' \(my_rewards:boom\) raised KeyError"),
    ("short", r"returned 1 values for 3 completions"),
    ("nan", r"returned nan for completion 0: a finite number or None is required"),
])
def test_run_time_errors_name_the_function(user_module, fn, message):
    fns = RewardFunctions([RewardSpec(fn=f"{user_module}:{fn}")])
    try:
        with pytest.raises(RewardFunctionError, match=message):
            fns.score(["p"] * 3, COMPLETIONS, COLUMNS)
    finally:
        fns.close()


def test_a_hung_function_is_stopped_after_the_timeout(user_module):
    fns = RewardFunctions([RewardSpec(fn=f"{user_module}:hang")], timeout_s=2.0)
    try:
        with pytest.raises(RewardFunctionError, match=r"did not return within reward_timeout_s = 2"):
            fns.score(["p"] * 3, COMPLETIONS, COLUMNS)
        fns.specs = [RewardSpec(fn="exact")]  # the pool was replaced: the next batch runs
        assert fns.score(["p"], ["4"], {"answer": ["4"]}).rewards == [1.0]
    finally:
        fns.close()


def test_duplicate_labels_are_refused():
    with pytest.raises(RewardFunctionError, match="give them `name`s"):
        RewardFunctions([RewardSpec(fn="exact"), RewardSpec(fn="exact", weight=2.0)])


def test_reward_phase_leaves_skipped_samples_out_of_training(user_module):
    from orchestrator.batches import samples_batch
    from orchestrator.rewards import score_samples
    from rollout.samples import Sample, Samples
    from rollout.tasks import AdditionTask, Problem
    from trainer.batch import TokenDistribution

    problems = [Problem("t", "2+2=", "4", columns={"op": "+"}), Problem("t", "9-2=", "7", columns={"op": "-"})]
    samples = Samples([Sample(i // 2, "t", [1], [2], [-0.1], text=t) for i, t in enumerate(["4", "5", "7", "7"])])
    fns = RewardFunctions([RewardSpec(fn=f"{user_module}:parity"), RewardSpec(fn="exact", weight=0.0)])
    try:
        metrics = score_samples(AdditionTask(1), problems, samples, 0.0, fns)
    finally:
        fns.close()
    # parity skips '-' problems; exact (weight 0) scores every sample, so nothing is left without a reward
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 0.0] and metrics["excluded"] == 0
    fns = RewardFunctions([RewardSpec(fn=f"{user_module}:parity")])
    try:
        metrics = score_samples(AdditionTask(1), problems, samples, 0.0, fns)
    finally:
        fns.close()
    assert [s.reward for s in samples] == [1.0, 1.0, None, None] and metrics["excluded"] == 2
    assert metrics["reward_mean"] == 1.0 and metrics["reward/parity"] == 1.0
    assert [seq.group for seq in samples_batch(samples, TokenDistribution()).sequences] == [0, 0]


def test_length_reward_shapes_the_other_rewards_by_hand():
    """Kimi k1.5's length reward per prompt group: lam = 0.5 - (len - min) / (max - min); correct (the other
    rewards sum above 0.5) get lam, incorrect min(0, lam); a sample the others skipped stays None."""
    fns = RewardFunctions([RewardSpec(fn="exact"), RewardSpec(fn="length", weight=0.1)])
    try:
        got = fns.score(["p"] * 5, ["4", "4", "5", "x", "4"], {"answer": ["4", "4", "4", "4", "4"]},
                        lengths=[2, 6, 10, 3, 7], groups=[0, 0, 0, 1, 1])
    finally:
        fns.close()
    # group 0: lengths 2, 6, 10 -> lam 0.5, 0, -0.5; correct, correct, wrong -> 0.5, 0, -0.5
    # group 1: lengths 3, 7 -> lam 0.5, -0.5; wrong, correct -> min(0, 0.5) = 0, -0.5
    assert got.rewards == pytest.approx([1.05, 1.0, -0.05, 0.0, 0.95])
    assert got.per_function["reward/length"] == pytest.approx((0.5 + 0 - 0.5 + 0 - 0.5) / 5)
    with pytest.raises(RewardFunctionError, match="beside at least one other"):
        RewardFunctions([RewardSpec(fn="length")])
