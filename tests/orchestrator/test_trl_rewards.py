"""TRL's own reward functions give the same values under tide as under TRL, on the same rows and completions.

"Under TRL" is TRL 1.16's GRPOTrainer itself: one real training step on CPU with a tiny local model, whose
`rollout_func` hands it fixed completions (as token ids, which TRL decodes itself), so that its reward code runs
as in any GRPO run. Both sides call the same recording wrappers of `trl.rewards.accuracy_reward` and
`trl.rewards.think_format_reward` (functools.wraps: tide checks the real signatures), which write down exactly
what each call was given and returned; tide runs the rows as a `.jsonl` dataset through its DatasetTask, prompt
renderer (with a system prompt, which TRL's call does not see) and reward phase."""
import json
import sys
import textwrap

import pytest

ROWS = [
    {"prompt": [{"role": "user", "content": "Write one third as a fraction."}], "solution": "\\frac{1}{3}",
     "level": 1},
    {"prompt": [{"role": "user", "content": "What is 6 times 7?"}], "solution": "42", "level": 2},
    {"prompt": [{"role": "user", "content": "Name a fruit."}], "solution": "banana", "level": 3},  # gold: None
    {"prompt": [{"role": "user", "content": "Square x."}], "solution": "$x^2$", "level": 1},
]
COMPLETIONS = [  # two per row, in the dataset's order
    ["<think>1 of 3</think> The answer is \\boxed{\\frac{1}{3}}", "\\boxed{\\frac{1}{2}}"],
    ["<think>6*7</think>\\boxed{42}", "<think>unclosed \\boxed{42}"],
    ["<think>a fruit</think> \\boxed{3}", "banana"],
    ["\\boxed{x^2}", "<think>a</think><think>b</think> \\boxed{x^3}"],
]
WEIGHTS = (1.0, 0.5)

RECORDER = '''
import functools, json, os

import trl.rewards

CALLABLES = ("trainer_state", "log_extra", "log_metric")


def _recording(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        logged = []
        if kwargs.get("log_extra") is not None:
            log_extra = kwargs["log_extra"]

            def spy(column, values):
                logged.append([column, list(values)])
                log_extra(column, values)

            kwargs["log_extra"] = spy
        out = func(*args, **kwargs)
        state = kwargs.get("trainer_state")
        record = {"fn": func.__name__, "positional": len(args), "out": out, "logged": logged,
                  "callables": sorted(k for k in CALLABLES if k in kwargs),
                  "state": [state.global_step, state.max_steps] if state is not None else None,
                  "kwargs": {k: v for k, v in kwargs.items() if k not in CALLABLES}}
        with open(os.environ["TIDE_TRL_RECORD"], "a") as f:
            f.write(json.dumps(record) + "\\n")
        return out
    return wrapper


accuracy_reward = _recording(trl.rewards.accuracy_reward)
think_format_reward = _recording(trl.rewards.think_format_reward)
'''


@pytest.fixture(scope="module")
def recorder(tmp_path_factory):
    d = tmp_path_factory.mktemp("recorder")
    (d / "trl_recorder.py").write_text(textwrap.dedent(RECORDER))
    sys.path.insert(0, str(d))  # spawned reward workers inherit the path
    yield "trl_recorder"
    sys.path.remove(str(d))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    corpus = "\n".join(m["content"] for r in ROWS for m in r["prompt"]) + "\n" + "\n".join(sum(COMPLETIONS, []))
    spec = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", corpus, spec))


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_trl(recorder_module, tokenizer, work, monkeypatch) -> tuple[list[dict], list[list[float]], list[float]]:
    """One GRPOTrainer step on ROWS with COMPLETIONS; the recorded calls, TRL's rewards_per_func (NaN: None)
    and its reward weights."""
    import importlib

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("TIDE_TRL_RECORD", str(work / "trl.jsonl"))
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rec = importlib.import_module(recorder_module)
    served = {i: 0 for i in range(len(ROWS))}

    def rollout_func(prompts, trainer):
        """The completions TRL decodes and scores: each row's next one, as token ids ending with EOS."""
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for prompt in prompts:
            row = next(i for i, r in enumerate(ROWS) if r["prompt"] == prompt)
            text = COMPLETIONS[row][served[row]]
            served[row] += 1
            ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            out["prompt_ids"].append(tokenizer(prompt[0]["content"], add_special_tokens=False).input_ids)
            out["completion_ids"].append(ids)
            out["logprobs"].append([0.0] * len(ids))
        return out

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tokenizer.name_or_path, dtype=torch.float32)
    args = GRPOConfig(output_dir=str(work / "trl"), use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                      disable_tqdm=True, max_steps=1, logging_steps=1, per_device_train_batch_size=8,
                      steps_per_generation=1, num_generations=2, max_completion_length=64, beta=0.0,
                      shuffle_dataset=False, reward_weights=list(WEIGHTS))
    trainer = GRPOTrainer(model=model, reward_funcs=[rec.accuracy_reward, rec.think_format_reward], args=args,
                          train_dataset=Dataset.from_list(ROWS), processing_class=tokenizer, rollout_func=rollout_func)
    per_func: list[torch.Tensor] = []
    calculate = trainer._calculate_rewards

    def capture(*a, **kw):
        per_func.append(calculate(*a, **kw))
        return per_func[-1]

    trainer._calculate_rewards = capture
    trainer.train()
    assert len(per_func) == 1 and served == {i: 2 for i in range(len(ROWS))}
    return _records(work / "trl.jsonl"), per_func[0].tolist(), trainer.reward_weights.tolist()


def run_tide(recorder_module, tokenizer, work, monkeypatch, trl_call: dict):
    """The same rows as a .jsonl dataset, rendered with a system prompt; samples in TRL's order with TRL's
    decoded texts and token ids; scored by tide's reward phase."""
    from orchestrator.workers.prompts import PromptRenderer, RenderedTask
    from orchestrator.rewards.functions import RewardFunctions, RewardSpec, TrainerState
    from orchestrator.rewards.phase import reward_columns, reward_phase
    from rollout.samples import Sample, Samples
    from rollout.tasks.dataset import DatasetTask

    monkeypatch.setenv("TIDE_TRL_RECORD", str(work / "tide.jsonl"))  # read by the spawned reward worker
    data = work / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    task = RenderedTask(DatasetTask(str(data), prompt_field="prompt", answer_field="solution"),
                        PromptRenderer(tokenizer, "auto", system_prompt="Be brief."))
    problems = task.problems(0, 0, len(ROWS))
    assert all(p.prompt.startswith("system: Be brief.") for p in problems)  # what the engines would see
    index = {p.messages[0]["content"]: i for i, p in enumerate(problems)}
    kw = trl_call["kwargs"]
    samples = Samples([Sample(index[prompt[0]["content"]], "t", list(problems[index[prompt[0]["content"]]].prompt_ids),
                              ids, [0.0] * len(ids), text=completion[0]["content"])
                       for prompt, completion, ids in zip(kw["prompts"], kw["completions"], kw["completion_ids"])])
    specs = [RewardSpec(fn=f"{recorder_module}:accuracy_reward", weight=WEIGHTS[0]),
             RewardSpec(fn=f"{recorder_module}:think_format_reward", weight=WEIGHTS[1])]
    fns = RewardFunctions(specs, columns=reward_columns(problems[0]))
    try:
        phase = reward_phase(task, problems, samples, 0.0, fns, trainer_state=TrainerState(global_step=0, max_steps=1))
    finally:
        fns.close()
    return _records(work / "tide.jsonl"), [s.reward for s in samples], phase


def test_trl_reward_functions_give_the_same_values_under_tide_and_under_trl(recorder, tokenizer, tmp_path,
                                                                            monkeypatch):
    trl_calls, per_func, weights = run_trl(recorder, tokenizer, tmp_path, monkeypatch)
    assert [c["fn"] for c in trl_calls] == ["accuracy_reward", "think_format_reward"] and weights == list(WEIGHTS)
    decoded = [c[0]["content"] for c in trl_calls[0]["kwargs"]["completions"]]
    assert decoded == [c for pair in COMPLETIONS for c in pair]  # TRL decoded the ids back to the texts
    accuracy = trl_calls[0]["out"]
    assert None in accuracy and 1.0 in accuracy and 0.0 in accuracy  # skipped (unparseable gold), right, wrong
    tide_calls, rewards, phase = run_tide(recorder, tokenizer, tmp_path, monkeypatch, trl_calls[0])

    # every call: the same keywords with the same values (none positional), the same state, the same return
    assert len(tide_calls) == len(trl_calls)
    for trl_call, tide_call in zip(trl_calls, tide_calls):
        assert tide_call == trl_call, trl_call["fn"]
    assert trl_calls[0]["positional"] == 0 and trl_calls[0]["callables"] == ["log_extra", "log_metric",
                                                                             "trainer_state"]
    assert set(trl_calls[0]["kwargs"]) == {"prompts", "completions", "completion_ids", "solution", "level"}
    assert trl_calls[0]["kwargs"]["prompts"][0] == ROWS[0]["prompt"]  # the dataset's messages, no system prompt

    # the values TRL used (NaN for None) and their weighted sum, sample by sample
    for i, (row, reward) in enumerate(zip(per_func, rewards)):
        scored = [(w, v) for w, v in zip(weights, row) if v == v]  # v != v: NaN, what TRL makes of None
        expected = sum(w * v for w, v in scored) if scored else None
        assert reward == (pytest.approx(expected) if scored else None), (i, row, reward)
        assert [None if v != v else v for v in row] == [trl_calls[0]["out"][i], trl_calls[1]["out"][i]]
    # accuracy_reward's log_extra columns, as it logged them under TRL
    assert phase.extra_columns == {column: values for column, values in trl_calls[0]["logged"]}
    assert phase.metrics["reward/think_format_reward"] == pytest.approx(sum(trl_calls[1]["out"]) / 8)
