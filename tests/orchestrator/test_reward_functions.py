"""Pluggable rewards: built-ins against hand values, users' functions called as TRL calls them (by keyword, with
completion_ids, trainer_state, log_metric and log_extra) or as veRL calls compute_score, in a worker process;
None excluding a sample, and every way a function can fail named at start-up or at run time."""
import json
import sys
import textwrap

import pytest

from orchestrator.rewards.functions import (RewardBatch, RewardFunctionError, RewardFunctions, RewardSpec, TrainerState,
                                           load_reward_function)

USER_MODULE = '''
import asyncio, os, time

def parity(prompts, completions, answer, op, **kw):
    """1 for an even answer on '+' problems, None (not applicable) on the others."""
    return [float(int(a) % 2 == 0) if o == "+" else None for a, o in zip(answer, op)]

async def slow_half(prompts, completions, **kw):
    await asyncio.sleep(0)
    return [0.5] * len(completions)

def no_kwargs(prompts, completions):
    return [0.0] * len(completions)

def every_keyword(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, answer, op):
    return [0.0] * len(completions)

def positional_only(prompts, completions, /, **kw):
    return [0.0] * len(completions)

def needs_level(completions, level, **kw):
    return [None if x is None else float(x) for x in level]

def takes_the_call(completions, completion_ids, trainer_state, log_extra, log_metric, **kw):
    """Reports what it was given: values = token counts; a metric and extra columns through TRL's callables."""
    log_metric("step", trainer_state.global_step)
    log_metric("step", trainer_state.max_steps)
    log_extra("seen", [repr(c) for c in completions])
    log_extra("keywords", [" ".join(sorted(kw))] * len(completions))
    return [float(len(ids)) for ids in completion_ids]

def boom(prompts, completions, **kw):
    raise KeyError("no such column")

def short(prompts, completions, **kw):
    return [1.0]

def nan(prompts, completions, **kw):
    return [float("nan")] * len(completions)

def bad_metric(completions, log_metric, **kw):
    log_metric("m", "high")
    return [0.0] * len(completions)

def bad_extra(completions, log_extra, **kw):
    log_extra("c", [1])
    return [0.0] * len(completions)

def hang_once(completions, marker, **kw):
    """Hangs on the first call only (a marker file remembers it across worker processes)."""
    if not os.path.exists(marker[0]):
        open(marker[0], "w").close()
        time.sleep(60)
    return [1.0] * len(completions)
'''

VERL_MODULE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """veRL's layout: 1 for the ground truth; a dict on `math` rows with an accuracy and the parsed answer."""
    score = float(solution_str.strip() == str(ground_truth))
    if data_source == "math":
        return {"score": score, "acc": score == 1.0, "pred": solution_str.strip(), "bonus": extra_info["bonus"]}
    return score if extra_info.get("skip") is not True else None

async def compute_score_async(data_source, solution_str, ground_truth, extra_info=None):
    return 0.25

def strict(data_source, solution_str, ground_truth):
    return 0.0

def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}

def echo_style(solution_str, ground_truth, **kwargs):
    return [1.0]
'''


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("user")
    (d / "my_rewards.py").write_text(textwrap.dedent(USER_MODULE))
    (d / "verl_rewards.py").write_text(textwrap.dedent(VERL_MODULE))
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))


@pytest.fixture(scope="module")
def user_module(user_dir):
    return "my_rewards"


COLUMNS = {"answer": ["4", "3", "7"], "op": ["+", "+", "-"]}
COMPLETIONS = ["4", "the answer is \\boxed{3}", "6"]


def _score(specs, *args, **kwargs):
    fns = RewardFunctions(specs)
    try:
        return fns.score(*args, **kwargs)
    finally:
        fns.close()


def test_builtins_and_a_user_function_weighted(user_module):
    got = _score([RewardSpec(fn="numeric", weight=1.0), RewardSpec(fn=f"{user_module}:parity", weight=0.5)],
                 ["p"] * 3, COMPLETIONS, COLUMNS)
    # numeric: 1, 1 (extracted), 0; parity: 1 (4 even), 0 (3 odd), None ('-')
    assert got.rewards == [1.5, 1.0, 0.0]
    assert got.per_function == {"reward/numeric": pytest.approx(2 / 3), "reward/parity": 0.5}


def test_a_sample_every_function_skips_has_no_reward(user_module):
    assert _score([RewardSpec(fn=f"{user_module}:parity")], ["p"] * 3, COMPLETIONS, COLUMNS).rewards == \
        [1.0, 0.0, None]


def test_coroutine_functions_are_awaited(user_module):
    assert _score([RewardSpec(fn=f"{user_module}:slow_half")], ["p"] * 3, COMPLETIONS, COLUMNS).rewards == \
        [0.5, 0.5, 0.5]


def test_math_verify_builtin_by_hand():
    got = _score([RewardSpec(fn="math")], ["p"] * 3, ["\\boxed{\\frac{1}{2}}", "0.5", "\\boxed{2}"],
                 {"answer": ["0.5", "1/2", "3"]})
    assert got.rewards == [1.0, 1.0, 0.0]


def test_trl_call_by_keyword_with_ids_state_metrics_and_extra_columns(user_module):
    """Everything by keyword: chat prompts get message completions; completion_ids, trainer_state; log_metric's
    values averaged into reward/<label>/<name>, log_extra's columns returned with the scores."""
    fns = RewardFunctions([RewardSpec(fn=f"{user_module}:takes_the_call", name="probe")])
    try:
        chat = [[{"role": "user", "content": "2+2="}]] * 2
        got = fns.score_batch(RewardBatch(chat, ["4", "five"], {"solution": ["4", "4"]}, ["4", "4"],
                                          completion_ids=[[7], [8, 9]], trainer_state=TrainerState(3, 10)))
        plain = fns.score(["2+2="], ["4"], {"answer": ["4"]})
    finally:
        fns.close()
    assert got.rewards == [1.0, 2.0]
    assert got.per_function == {"reward/probe": 1.5, "reward/probe/step": 6.5}
    assert got.extra_columns == {
        "seen": [repr([{"role": "assistant", "content": "4"}]), repr([{"role": "assistant", "content": "five"}])],
        "keywords": ["prompts solution"] * 2}  # the column by its own name, no `answer` added for it
    assert plain.extra_columns["seen"] == ["'4'"] and plain.extra_columns["keywords"] == ["answer prompts"]
    assert plain.rewards == [0.0]  # no token ids known: [] each


def test_builtins_get_the_reference_answer_whatever_its_column(user_module):
    """`answer` is tide's own argument to its built-ins: the reference answer, not a column of that name."""
    fns = RewardFunctions([RewardSpec(fn="exact")])
    try:
        got = fns.score_batch(RewardBatch(["p"] * 2, ["4", "5"], {"solution": ["4", "4"]}, answers=[4, 5]))
    finally:
        fns.close()
    assert got.rewards == [1.0, 1.0]


@pytest.mark.parametrize("fn,message", [
    ("nope", r"not a built-in \(exact, numeric, math, code, length\) nor 'package.module:function' nor "
             r"'path/to/file.py:function'"),
    ("no_such_module_xyz:f", r"cannot import no_such_module_xyz: ModuleNotFoundError"),
    ("{m}:missing", r"has no function 'missing'"),
    ("/no/such/dir/rewards.py:f", r"no such file /no/such/dir/rewards.py"),
])
def test_start_up_errors_name_the_function(user_module, fn, message):
    with pytest.raises(RewardFunctionError, match=message):
        load_reward_function(fn.format(m=user_module))


def test_a_function_from_a_file_path(user_dir, tmp_path):
    got = _score([RewardSpec(fn=f"{user_dir / 'my_rewards.py'}:parity")], ["p"] * 3, COMPLETIONS, COLUMNS)
    assert got.rewards == [1.0, 0.0, None] and "reward/parity" in got.per_function
    (tmp_path / "broken.py").write_text("import no_such_module_xyz\n")
    with pytest.raises(RewardFunctionError, match=r"broken.py:f'.*cannot import .*broken.py: ModuleNotFoundError"):
        load_reward_function(f"{tmp_path / 'broken.py'}:f")


@pytest.mark.parametrize("fn,columns,message", [
    # TRL passes completion_ids, trainer_state, log_extra, log_metric to every function
    ("no_kwargs", None, r"reward 'no_kwargs' \(my_rewards:no_kwargs\) cannot take its call: it takes no "
                        r"completion_ids, log_extra, log_metric, trainer_state \(and no \*\*kwargs\)"),
    ("positional_only", None, r"prompts, completions are positional-only"),
    ("needs_level", {"answer": "4", "op": "+"},
     r"nothing is passed as its parameter\(s\) level; .*the columns answer, op"),
    ("every_keyword", {"answer": "4", "op": "+", "level": 1}, r"it takes no level \(and no \*\*kwargs\)"),
])
def test_a_function_that_cannot_take_the_call_is_refused_at_start_up(user_module, fn, columns, message):
    with pytest.raises(RewardFunctionError, match=message):
        RewardFunctions([RewardSpec(fn=f"{user_module}:{fn}")], columns=columns)


def test_functions_trl_accepts_pass_the_start_up_check(user_module):
    specs = [RewardSpec(fn="trl.rewards:accuracy_reward"), RewardSpec(fn="trl.rewards:think_format_reward"),
             RewardSpec(fn=f"{user_module}:needs_level")]
    RewardFunctions(specs, columns={"level": 1, "solution": "4"}).close()
    # no **kwargs: fine when it names every keyword and every column
    RewardFunctions([RewardSpec(fn=f"{user_module}:every_keyword")], columns={"answer": "4", "op": "+"}).close()


def test_cli_exits_2_naming_a_function_that_cannot_take_the_call(user_dir, tmp_path):
    """`tide run` with a reward function (from a file) that takes no **kwargs: refused before anything starts."""
    import subprocess
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1="}], "answer": "2"}) + "\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"name": "t", "iterations": 1,
                                   "task": {"name": "dataset", "path": str(data), "prompt_field": "messages"},
                                   "rollout": {"max_prompt_tokens": 64, "max_new_tokens": 8},
                                   "rewards": [{"fn": f"{user_dir / 'my_rewards.py'}:no_kwargs"}]}))
    proc = subprocess.run([sys.executable, "-m", "orchestrator.run.cli", "run", str(cfg),
                           "--run-dir", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=300, cwd=root,
                          env={**__import__("os").environ, "TIDE_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "reward 'no_kwargs'" in proc.stderr and "cannot take its call" in proc.stderr


def test_columns_unknown_at_start_up_are_checked_at_the_first_batch(user_module):
    fns = RewardFunctions([RewardSpec(fn=f"{user_module}:needs_level")])
    try:
        with pytest.raises(RewardFunctionError, match=r"nothing is passed as its parameter\(s\) level"):
            fns.score(["p"] * 3, COMPLETIONS, COLUMNS)
        assert fns.score(["p"], ["4"], {"answer": ["4"], "level": [2]}).rewards == [2.0]
    finally:
        fns.close()


def test_a_column_mapping_feeds_a_keyword_from_a_nested_column(user_module):
    """`columns: {level: meta.difficulty}`: the keyword gets the nested value; a path leading nowhere in the
    example row is refused at start-up with the columns listed."""
    spec = RewardSpec(fn=f"{user_module}:needs_level", columns={"level": "meta.difficulty"})
    got = _score([spec], ["p"] * 2, ["a", "b"], {"answer": ["1", "2"], "meta": [{"difficulty": 3}, {}]})
    assert got.rewards == [3.0, None]  # a row without the nested field: None (no opinion)
    with pytest.raises(RewardFunctionError, match=r"columns: \{level: meta.level\}: no such column; the columns: "
                                                  r"answer, meta"):
        RewardFunctions([spec.model_copy(update={"columns": {"level": "meta.level"}})],
                        columns={"answer": "1", "meta": {"difficulty": 3}})


@pytest.mark.parametrize("fn,message", [
    ("boom", r"reward 'boom' \(my_rewards:boom\) raised KeyError"),
    ("short", r"returned 1 values for 3 completions"),
    ("nan", r"returned nan for completion 0: a finite number or None is required"),
    ("bad_metric", r"reward 'bad_metric' .* logged metric 'm' = 'high': a number is required"),
    ("bad_extra", r"reward 'bad_extra' .* logged column 'c' with 1 values for 3 completions"),
])
def test_run_time_errors_name_the_function(user_module, fn, message):
    with pytest.raises(RewardFunctionError, match=message):
        _score([RewardSpec(fn=f"{user_module}:{fn}")], ["p"] * 3, COMPLETIONS, COLUMNS)


def test_a_hung_function_is_stopped_after_the_timeout(user_module, tmp_path):
    fns = RewardFunctions([RewardSpec(fn=f"{user_module}:hang_once")], timeout_s=2.0)
    columns = {"answer": ["4"], "marker": [str(tmp_path / "hung")]}
    try:
        with pytest.raises(RewardFunctionError, match=r"did not return within reward_timeout_s = 2"):
            fns.score(["p"], ["4"], columns)
        assert fns.score(["p"], ["4"], columns).rewards == [1.0]  # the pool was replaced: the next batch runs
    finally:
        fns.close()


def test_duplicate_labels_are_refused():
    with pytest.raises(RewardFunctionError, match="give them `name`s"):
        RewardFunctions([RewardSpec(fn="exact"), RewardSpec(fn="exact", weight=2.0)])


def test_builtins_refuse_a_style():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="'math' is a built-in"):
        RewardSpec(fn="math", style="verl")


def test_verl_compute_score_by_hand(user_module):
    """veRL's call per completion: data_source and extra_info from the row ({} where absent), ground_truth the
    problem's answer (veRL's reward_model.ground_truth), solution_str the text; a dict's score is the reward, its
    other numeric keys metrics (means), the rest extra columns; None: no opinion; async awaited."""
    columns = {"data_source": ["math", "math", "gsm8k", "gsm8k"],
               "extra_info": [{"bonus": 2}, {"bonus": 4}, None, {"skip": True}],
               "reward_model": [{"ground_truth": "4"}, {"ground_truth": "5"}, {"ground_truth": "6"},
                                {"ground_truth": "7"}]}
    batch = RewardBatch(["p"] * 4, ["4", "4", " 6 ", "7"], columns, answers=["4", "5", "6", "7"])
    fns = RewardFunctions([RewardSpec(fn="verl_rewards:compute_score"),
                           RewardSpec(fn="verl_rewards:compute_score_async", weight=2.0)],
                          columns={k: v[0] for k, v in columns.items()})
    try:
        got = fns.score_batch(batch)
    finally:
        fns.close()
    # compute_score: 1 (dict), 0 (dict), 1, None (skip); compute_score_async: 0.25 each, weight 2
    assert got.rewards == [1.5, 0.5, 1.5, 0.5]
    assert got.per_function == {"reward/compute_score": pytest.approx(2 / 3),
                                "reward/compute_score/acc": 0.5, "reward/compute_score/bonus": 3.0,
                                "reward/compute_score_async": 0.25}
    assert got.extra_columns == {"pred": ["4", "4", None, None]}


def test_verl_style_detection_and_refusals(user_module):
    from orchestrator.rewards.functions import call_style

    for fn, style, expected in [("verl_rewards:compute_score", "auto", "verl"),
                                ("verl_rewards:echo_style", "trl", "trl"), (f"{user_module}:parity", "auto", "trl"),
                                (f"{user_module}:slow_half", "verl", "verl")]:
        spec = RewardSpec(fn=fn, style=style)
        assert call_style(spec, load_reward_function(fn)) == expected, fn
    # veRL passes extra_info to every call; a TRL function run veRL's way cannot take solution_str
    with pytest.raises(RewardFunctionError, match=r"it takes no extra_info \(and no \*\*kwargs\).*veRL style"):
        RewardFunctions([RewardSpec(fn="verl_rewards:strict")])
    with pytest.raises(RewardFunctionError,
                       match=r"nothing is passed as its parameter\(s\) prompts, completions, answer, op"):
        RewardFunctions([RewardSpec(fn=f"{user_module}:parity", style="verl")])
    with pytest.raises(RewardFunctionError, match=r"returned \{'acc': 1.0\} for completion 0: .*'score'"):
        _score([RewardSpec(fn="verl_rewards:no_score")], ["p"], ["4"], {"answer": ["4"]})


def test_verl_ground_truth_is_the_nested_answer_of_a_dataset_row(user_module, tmp_path):
    """A veRL-layout parquet row through the dataset task and the reward phase: answer_field
    reward_model.ground_truth, data_source and extra_info columns as they are."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from orchestrator.rewards.phase import reward_columns, reward_phase
    from rollout.samples import Sample, Samples
    from rollout.tasks.dataset import DatasetTask

    rows = [{"data_source": "math", "prompt": [{"role": "user", "content": "2+2="}],
             "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"bonus": 1}},
            {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "3+3="}],
             "reward_model": {"style": "rule", "ground_truth": "6"}, "extra_info": {"bonus": 0}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    task = DatasetTask(str(tmp_path / "train.parquet"), answer_field="reward_model.ground_truth")
    problems = sorted(task.problems(0, 0, 2), key=lambda p: p.answer)
    assert set(reward_columns(problems[0])) == {"data_source", "reward_model", "extra_info"}
    samples = Samples([Sample(0, "t", [1], [2], [0.0], text="4"), Sample(1, "t", [1], [2], [0.0], text="5")])
    fns = RewardFunctions([RewardSpec(fn="verl_rewards:compute_score"),
                           RewardSpec(fn="trl.rewards:accuracy_reward", name="acc", weight=0.0,
                                      columns={"solution": "reward_model.ground_truth"})],
                          columns=reward_columns(problems[0]))
    try:
        phase = reward_phase(task, problems, samples, 0.0, fns)
    finally:
        fns.close()
    assert [s.reward for s in samples] == [1.0, 0.0]
    assert phase.metrics["reward/compute_score/bonus"] == 1.0 and phase.extra_columns["pred"] == ["4", None]
    assert phase.extra_columns["solution"] == ["4", "6"]  # accuracy_reward's log_extra: the mapped column


def test_reward_phase_leaves_skipped_samples_out_of_training(user_module):
    from orchestrator.iteration.batches import samples_batch
    from orchestrator.rewards.phase import reward_phase
    from rollout.samples import Sample, Samples
    from rollout.tasks import AdditionTask, Problem
    from trainer.batch import TokenDistribution

    problems = [Problem("t", "2+2=", "4", columns={"op": "+"}), Problem("t", "9-2=", "7", columns={"op": "-"})]
    samples = Samples([Sample(i // 2, "t", [1], [2], [-0.1], text=t) for i, t in enumerate(["4", "5", "7", "7"])])
    fns = RewardFunctions([RewardSpec(fn=f"{user_module}:parity"), RewardSpec(fn="exact", weight=0.0)])
    try:
        metrics = reward_phase(AdditionTask(1), problems, samples, 0.0, fns).metrics
    finally:
        fns.close()
    # parity skips '-' problems; exact (weight 0) scores every sample, so nothing is left without a reward
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 0.0] and metrics["excluded"] == 0
    fns = RewardFunctions([RewardSpec(fn=f"{user_module}:parity")])
    try:
        metrics = reward_phase(AdditionTask(1), problems, samples, 0.0, fns).metrics
    finally:
        fns.close()
    assert [s.reward for s in samples] == [1.0, 1.0, None, None] and metrics["excluded"] == 2
    assert metrics["reward_mean"] == 1.0 and metrics["reward/parity"] == 1.0
    assert [seq.group for seq in samples_batch(samples, TokenDistribution()).sequences] == [0, 0]


def test_length_reward_shapes_the_other_rewards_by_hand():
    """Kimi k1.5's length reward per prompt group: lam = 0.5 - (len - min) / (max - min); correct (the other
    rewards sum above 0.5) get lam, incorrect min(0, lam); a sample the others skipped stays None."""
    got = _score([RewardSpec(fn="exact"), RewardSpec(fn="length", weight=0.1)], ["p"] * 5,
                 ["4", "4", "5", "x", "4"], {"answer": ["4", "4", "4", "4", "4"]},
                 completion_ids=[[0] * n for n in (2, 6, 10, 3, 7)], groups=[0, 0, 0, 1, 1])
    # group 0: lengths 2, 6, 10 -> lam 0.5, 0, -0.5; correct, correct, wrong -> 0.5, 0, -0.5
    # group 1: lengths 3, 7 -> lam 0.5, -0.5; wrong, correct -> min(0, 0.5) = 0, -0.5
    assert got.rewards == pytest.approx([1.05, 1.0, -0.05, 0.0, 0.95])
    assert got.per_function["reward/length"] == pytest.approx((0.5 + 0 - 0.5 + 0 - 0.5) / 5)
    with pytest.raises(RewardFunctionError, match="beside at least one other"):
        RewardFunctions([RewardSpec(fn="length")])
    with pytest.raises(ValueError, match="reads no columns"):
        RewardSpec(fn="length", columns={"x": "y"})


def test_a_raising_function_is_an_input_error_reported_with_its_own_traceback(user_module, tmp_path):
    """Its traceback comes from the worker process it ran in: the console shows it after the reason, and
    RUN_DIR/error.log holds it with tide's; exit 2, which --max-restarts never retries."""
    from orchestrator.run.failures import console_report, exit_code, write_error_log

    with pytest.raises(RewardFunctionError) as raised:
        _score([RewardSpec(fn=f"{user_module}:boom")], ["p"] * 3, COMPLETIONS, COLUMNS)
    error = raised.value
    assert exit_code(error) == 2 and exit_code(RuntimeError("a rank died")) == 1
    assert 'in boom' in error.user_traceback and 'raise KeyError("no such column")' in error.user_traceback
    log = write_error_log(tmp_path, error)
    report = console_report(error, log)
    lines = report.splitlines()
    assert lines[0] == "error: RewardFunctionError: reward 'boom' (my_rewards:boom) raised KeyError: 'no such column'"
    assert 'raise KeyError("no such column")' in report and lines[-1] == f"(the whole traceback: {log})"
    text = log.read_text()
    assert text.index("in boom") < text.index("where tide met it") < text.index("in _outcome")
