"""Teaching a tool: warm-start demonstrations that call a tool the agent does not have (or with arguments its
signature does not take) stop the run before anything starts, naming the call, where it is written, the tools and
what to do; a dataset brings its own demonstrations (`task.demonstrations_field`), read and checked row by row and
laid out as the agent's rollouts lay out trajectories."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from orchestrator.config.schema import ConfigError, load_config, parse_config
from orchestrator.iteration.warmup import check_demonstrations, written_conversations
from rollout.tasks import TaskDataError, make_task

TOOLS = '''
def calculator(a: int, b: int) -> int:
    """Multiplies two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a * b


def echo(text: str) -> str:
    """Returns its text.

    Args:
        text: Any text.
    """
    return text


def python(source: str) -> str:
    """A tool named `python` whose argument is not `code`.

    Args:
        source: Python source.
    """
    return source
'''


def _call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _demo(a: int, b: int) -> list[dict]:
    return [{"role": "assistant", "content": "", "tool_calls": [_call("calculator", {"a": a, "b": b})]},
            {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": str(a * b)}]


def _setup(tmp_path: Path, rows: list[dict], tools: list[str], data: str = "data.jsonl", **trainer) -> tuple:
    """A config beside tools.py and the data file (.jsonl or .parquet); its task, a renderer's task and the agent,
    built as a run builds them."""
    from transformers import AutoTokenizer

    from orchestrator.agents.agent_rollout import Agent
    from orchestrator.workers.prompts import PromptRenderer, RenderedTask
    from orchestrator.config.model_source import resolve_model_dir

    (tmp_path / "tools.py").write_text(TOOLS)
    if data.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp_path / data)
    else:
        (tmp_path / data).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "name": "t", "iterations": 1, "model": {"tiny": {"hidden_size": 64, "num_layers": 1, "num_heads": 2,
                                                         "num_kv_heads": 1, "intermediate_size": 64}},
        "task": {"name": "dataset", "path": data, "demonstrations_field": "demo"},
        "agent": {"tools": tools, "max_total_tokens": 200},
        "trainer": {"warmup_sft_steps": 2, "warmup_sft_batch": 2, **trainer}}))
    cfg = load_config(tmp_path / "c.yaml")
    task = make_task(cfg.task, seed=cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(cfg.model.path, cfg.model.tiny, task, cfg.seed))
    renderer = PromptRenderer(tokenizer, cfg.model.chat_template, None, None, "skip")
    agent = Agent(cfg.agent, tokenizer, renderer.template, None, 16, None, cfg.task.name)
    return cfg, RenderedTask(task, renderer), agent


def test_demonstrations_calling_a_tool_the_agent_lacks_stop_the_run_before_anything_starts(tmp_path):
    """The issue's run: multiply's demonstrations call `python`, the config's only tool is `calculator`."""
    from orchestrator.records.rundir import RunDir
    from orchestrator.iteration.session import Session

    (tmp_path / "tools.py").write_text(TOOLS)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "name": "t", "iterations": 1, "model": {"tiny": {"hidden_size": 64, "num_layers": 1, "num_heads": 2,
                                                         "num_kv_heads": 1, "intermediate_size": 64}},
        "task": {"name": "multiply", "max_digits": 2},
        "agent": {"tools": ["tools.py:calculator"], "max_total_tokens": 64},
        "trainer": {"warmup_sft_steps": 5, "warmup_sft_batch": 4}}))
    cfg = load_config(tmp_path / "c.yaml")
    run = RunDir(tmp_path / "run")
    with pytest.raises(ConfigError) as refused:
        Session.open(cfg, run, resume=False)  # raises before Ray, engines or trainer start
    message = str(refused.value)
    for part in ("trainer.warmup_sft_steps", "task.name multiply's written demonstration 1 calls python(code=",
                 "agent.tools: calculator", "set trainer.warmup_sft_steps: 0", "add the tool to agent.tools",
                 "task.demonstrations_field"):
        assert part in message, part
    assert not run.config_file.exists()  # written once start-up checks passed, before Ray is connected


def test_a_demonstration_whose_arguments_the_tool_does_not_take_is_refused(tmp_path):
    cfg, task, agent = _setup(tmp_path, [{"prompt": "2*3=", "answer": "6", "demo": _demo(2, 3)}],
                              ["tools.py:python"])
    own = make_task(parse_config({"name": "t", "iterations": 1, "task": {"name": "multiply"}}).task)
    with pytest.raises(ConfigError, match=r"task.name multiply's written demonstration 1 calls python\(code="
                                          r".*\), which python\(source: str\) -> str does not take \(missing a "
                                          r"required argument: 'source'\)"):
        check_demonstrations(type(task)(own, task.renderer), cfg.trainer, cfg.seed, agent)
    check_demonstrations(type(task)(own, task.renderer), cfg.trainer.model_copy(update={"warmup_sft_steps": 0}),
                         cfg.seed, agent)  # no warm start: nothing to refuse


@pytest.mark.parametrize("data", ["data.jsonl", "data.parquet"])
def test_a_dataset_brings_its_own_demonstrations_laid_out_as_played(tmp_path, data):
    """Rows calling two tools: in a Parquet file every call carries every call's argument keys, the absent ones
    null; they are read back as written (a JSON string's too) and rendered as a played trajectory is."""
    from rollout.tasks import Problem
    from tests.rollout.rollout_helpers import scripted_generate

    def echo(arguments) -> list[dict]:
        return [{"role": "assistant", "content": "let me see", "tool_calls": [_call("echo", arguments)]},
                {"role": "tool", "content": "hi"}, {"role": "assistant", "content": "hi"}]
    rows = [{"prompt": [{"role": "user", "content": "2*3="}], "answer": "6", "demo": _demo(2, 3)},
            {"prompt": [{"role": "user", "content": "say hi"}], "answer": "hi", "demo": echo({"text": "hi"})}]
    if data.endswith(".jsonl"):
        rows.append({**rows[1], "demo": echo('{"text": "hi"}')})  # OpenAI's form: a JSON string
    cfg, task, agent = _setup(tmp_path, rows, ["tools.py:calculator", "tools.py:echo"], data)
    check_demonstrations(task, cfg.trainer, cfg.seed, agent)
    written = written_conversations(task, cfg.trainer, cfg.seed)
    expected = [[rows[0]["prompt"][0], *_demo(2, 3)], [rows[1]["prompt"][0], *echo({"text": "hi"})]]
    assert len(written) == 4 and all(c in expected for c in written) and expected[0] in written
    for conversation in expected:
        (demo,) = agent.demonstrations([conversation], task.renderer.end_of_turn_ids())
        call = agent._as_written(conversation[1])["content"]
        problem = Problem("0", "", conversation[-1]["content"], messages=(conversation[0],))
        played = agent.rollout(scripted_generate(agent.tokenizer, {0: [call, conversation[-1]["content"]]}),
                               [problem], 1, seed=0, version=0)
        s = played.samples.items[0]
        assert played.metrics["tools/failure_frequency"] == 0
        assert [m["content"] for m in s.conversation if m["role"] == "tool"] == [conversation[2]["content"]]
        assert (demo.prompt_ids, demo.completion_ids) == (s.prompt_ids, s.completion_ids)
        assert demo.loss_mask == [float(m) for m in s.loss_mask]


def test_a_dataset_row_calling_an_unknown_tool_is_named(tmp_path):
    rows = [{"prompt": "2*3=", "answer": "6", "demo": _demo(2, 3)},
            {"prompt": "4*5=", "answer": "20", "demo": [
                {"role": "assistant", "content": "", "tool_calls": [_call("search", {"a": 1})]},
                {"role": "tool", "content": "x"}, {"role": "assistant", "content": "20"}]}]
    cfg, task, agent = _setup(tmp_path, rows, ["tools.py:calculator"])
    with pytest.raises(ConfigError, match=r"data.jsonl: row 2: field 'demo' calls search\(a=1\); agent.tools: "
                                          r"calculator"):
        check_demonstrations(task, cfg.trainer, cfg.seed, agent)


BAD = [
    ({"prompt": "2*3=", "answer": "6"}, r"row 2: field 'demo' \(task.demonstrations_field\): missing or null"),
    ({"prompt": "2*3=", "answer": "6", "demo": []}, r"row 2: .* not an empty list"),
    ({"prompt": "2*3=", "answer": "6", "demo": [{"role": "assistant", "content": "6", "tool_calls": None},
                                                 {"role": "system", "content": "x", "tool_calls": None}]},
     r"row 2: field 'demo' \(task.demonstrations_field\): message 2: .* role is one of assistant, tool, user, "
     r"not 'system'"),
    ({"prompt": "2*3=", "answer": "6", "demo": [{"role": "assistant", "content": "", "tool_calls": None}]},
     r"row 2: .*message 1: an assistant message without content nor tool_calls"),
    ({"prompt": "2*3=", "answer": "6", "demo": [{"role": "tool", "content": "6", "tool_calls": None},
                                                 {"role": "assistant", "content": "6", "tool_calls": None}]},
     r"row 2: .*starts with the model's turn"),
    ({"prompt": "2*3=", "answer": "6", "demo": [{"role": "assistant", "content": "6", "tool_calls": None},
                                                 {"role": "tool", "content": "6", "tool_calls": None},
                                                 {"role": "assistant", "content": "6", "tool_calls": None}]},
     r"row 2: .*message 2: a tool result follows an assistant message with `tool_calls`"),
]


@pytest.mark.parametrize("row, message", BAD)
def test_a_malformed_demonstration_names_its_row_and_field(tmp_path, row, message):
    good = {"prompt": "2*3=", "answer": "6", "demo": [{"role": "assistant", "content": "6", "tool_calls": None}]}
    (tmp_path / "data.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    cfg = parse_config({"name": "t", "iterations": 1, "task": {"name": "dataset", "path": "data.jsonl",
                                                                  "demonstrations_field": "demo"}}, config_dir=tmp_path)
    with pytest.raises(TaskDataError, match=message):
        make_task(cfg.task)


@pytest.mark.parametrize("demo, message", [
    ([{"role": "assistant", "content": "", "tool_calls": [_call("calculator", "{a: 1")]}],
     r"message 1: tool call 1: the arguments of 'calculator' are a string that is not JSON"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"name": "calculator"}]}],
     r"message 1: tool call 1: a tool call is \{\"type\": \"function\", \"function\""),
])
def test_a_malformed_call_names_its_row_field_and_message(tmp_path, demo, message):
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "p", "answer": "1", "demo": demo}) + "\n")
    cfg = parse_config({"name": "t", "iterations": 1, "task": {"name": "dataset", "path": "data.jsonl",
                                                                  "demonstrations_field": "demo"}}, config_dir=tmp_path)
    with pytest.raises(TaskDataError, match=r"data.jsonl: row 1: field 'demo' \(task.demonstrations_field\): "
                                            + message):
        make_task(cfg.task)


def test_demonstrations_need_a_dataset_and_an_agent(tmp_path):
    with pytest.raises(ConfigError, match=r"task.demonstrations_field is a column of a dataset"):
        parse_config({"name": "t", "iterations": 1, "task": {"name": "multiply", "demonstrations_field": "d"}})
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "2*3=", "answer": "6", "demo": _demo(2, 3)}) + "\n")
    cfg = parse_config({"name": "t", "iterations": 1, "task": {"name": "dataset", "path": "data.jsonl",
                                                                  "demonstrations_field": "demo"}}, config_dir=tmp_path)
    from orchestrator.workers.prompts import RenderedTask

    with pytest.raises(ConfigError, match=r"task.demonstrations_field: .* need an `agent:` section"):
        check_demonstrations(RenderedTask(make_task(cfg.task), None), cfg.trainer, cfg.seed, None)
