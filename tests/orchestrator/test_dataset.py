"""Users' datasets (task.name: dataset) and chat-format prompts: formats, columns, the resumable cursor, chat
templates, and bad input stopping at start-up with exit 2 and the file, row and field named."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.config.schema import ConfigError, parse_config
from orchestrator.iteration.evaluation import held_out_problems
from orchestrator.workers.prompts import PromptRenderer, RenderedTask
from rollout.tasks import TaskDataError
from rollout.tasks.dataset import DatasetTask

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"q": [{"role": "user", "content": f"{a}+1="}], "answer": a + 1, "level": a % 3} for a in range(6)]


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", "1+1=2\n",
                                                          TinyModelConfig()))


def test_formats_columns_and_messages(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = [{"prompt": f"{a}+1=", "answer": str(a + 1), "level": a % 3} for a in range(6)]
    pq.write_table(pa.Table.from_pylist(flat), tmp_path / "d.parquet")
    (tmp_path / "d.csv").write_text("prompt,answer,level\n" + "".join(f"{r['prompt']},{r['answer']},{r['level']}\n"
                                                                      for r in flat))
    for path in (_jsonl(tmp_path / "d.jsonl", flat), tmp_path / "d.parquet", tmp_path / "d.csv"):
        task = DatasetTask(str(path))
        got = sorted((p.prompt, p.answer, p.columns["level"]) for p in task.problems(0, 0, 6))
        assert got == sorted((r["prompt"], r["answer"], r["level"]) for r in flat), path
    chat = DatasetTask(str(_jsonl(tmp_path / "chat.jsonl", ROWS)), prompt_field="q")
    p = chat.problems(0, 0, 1)[0]
    # every column but the prompt's travels with the problem, the answer's under its own name (TRL's reward call)
    assert p.prompt == "" and p.messages[0]["role"] == "user" and set(p.columns) == {"answer", "level"}
    assert p.answer_field == "answer" and p.columns["answer"] == int(p.answer)


VERL_ROWS = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{a}+1="}],
              "reward_model": {"style": "rule", "ground_truth": str(a + 1)}, "extra_info": {"index": a}}
             for a in range(4)]


def test_nested_fields_with_dots(tmp_path):
    """veRL's parquet layout: the answer at reward_model.ground_truth; the prompt may be nested too; the
    columns keep the nested dicts whole."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(VERL_ROWS), tmp_path / "train.parquet")
    task = DatasetTask(str(tmp_path / "train.parquet"), answer_field="reward_model.ground_truth")
    got = sorted(task.problems(0, 0, 4), key=lambda p: p.answer)
    assert [p.answer for p in got] == ["1", "2", "3", "4"]
    assert [p.messages[0]["content"] for p in got] == ["0+1=", "1+1=", "2+1=", "3+1="]
    assert set(got[0].columns) == {"data_source", "reward_model", "extra_info"}
    assert got[0].columns["reward_model"] == {"style": "rule", "ground_truth": "1"}
    nested = [{"q": {"text": "1+1="}, "meta": {"gold": {"value": 2}}}]
    p = DatasetTask(str(_jsonl(tmp_path / "n.jsonl", nested)), prompt_field="q.text",
                    answer_field="meta.gold.value").problems(0, 0, 1)[0]
    assert (p.prompt, p.answer, set(p.columns)) == ("1+1=", "2", {"q", "meta"})
    dotted = [{"prompt": "1+1=", "a.b": "2"}]  # a column whose own name holds a dot is found first
    assert DatasetTask(str(_jsonl(tmp_path / "d.jsonl", dotted)), answer_field="a.b").problems(0, 0, 1)[0].answer == "2"


@pytest.mark.parametrize("rows,field,message", [
    ([VERL_ROWS[0], {**VERL_ROWS[1], "reward_model": {"style": "rule"}}], "reward_model.ground_truth",
     r"bad.jsonl: row 2: field 'reward_model.ground_truth' is missing or null \('reward_model' has 'style'"),
    ([VERL_ROWS[0], {**VERL_ROWS[1], "reward_model": None}], "reward_model.ground_truth",
     r"row 2: field 'reward_model.ground_truth' is missing or null \(the row has 'data_source', 'extra_info', "
     r"'prompt', 'reward_model'"),
    ([VERL_ROWS[0]], "reward_model.truth.value",
     r"row 1: field 'reward_model.truth.value' is missing or null \('reward_model' has 'ground_truth', 'style'"),
])
def test_missing_nested_fields_are_named(tmp_path, rows, field, message):
    with pytest.raises(TaskDataError, match=message):
        DatasetTask(str(_jsonl(tmp_path / "bad.jsonl", rows)), answer_field=field)


def test_cursor_is_a_pure_function_of_seed_and_iteration(tmp_path):
    path = str(_jsonl(tmp_path / "chat.jsonl", ROWS))
    a, b = DatasetTask(path, prompt_field="q"), DatasetTask(path, prompt_field="q")
    assert [p.answer for p in a.problems(3, 5, 4)] == [p.answer for p in b.problems(3, 5, 4)]
    epoch = [p.answer for it in range(3) for p in a.problems(3, it, 2)]  # 3 x 2 = one epoch of 6 rows
    assert sorted(epoch) == sorted(str(r["answer"]) for r in ROWS)


@pytest.mark.parametrize("rows,message", [
    ([{"q": "1+1=", "answer": "2"}, {"q": "2+2="}], r"row 2: field 'answer' is missing"),
    ([{"q": "1+1=", "answer": "2"}, {"q": 5, "answer": "3"}], r"row 2: field 'q' must be a string or a list"),
    ([{"q": [{"role": "user"}], "answer": "2"}], r"row 1: field 'q' must be a string or a list of \{role, content"),
])
def test_bad_rows_are_named(tmp_path, rows, message):
    with pytest.raises(TaskDataError, match=message):
        DatasetTask(str(_jsonl(tmp_path / "bad.jsonl", rows)), prompt_field="q")


def test_bad_paths_are_config_errors(tmp_path):
    base = {"name": "t", "iterations": 1}
    with pytest.raises(ConfigError, match=r"task.path: no such file"):
        parse_config({**base, "task": {"name": "dataset", "path": str(tmp_path / "none.jsonl")}})
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"task.path: .* is not one of .jsonl, .json, .parquet, .csv"):
        parse_config({**base, "task": {"name": "dataset", "path": str(tmp_path / "d.txt")}})
    with pytest.raises(ConfigError, match=r"task.eval_path: no such file"):
        parse_config({**base, "task": {"name": "dataset", "path": str(_jsonl(tmp_path / "d.jsonl", ROWS)),
                                       "eval_path": str(tmp_path / "none.jsonl")}})
    with pytest.raises(ConfigError, match=r"model.chat_template: .*no such file"):
        parse_config({**base, "model": {"chat_template": str(tmp_path / "none.jinja")}})


def test_cli_exits_2_naming_the_row_and_field(tmp_path):
    data = _jsonl(tmp_path / "bad.jsonl", [{"q": "1+1=", "answer": "2"}, {"q": "2+2="}])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"name": "t", "iterations": 1, "task": {"name": "dataset", "path": str(data),
                                                                          "prompt_field": "q"}}))
    proc = subprocess.run([sys.executable, "-m", "orchestrator.run.cli", "run", str(cfg),
                           "--run-dir", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{data}: row 2: field 'answer' is missing" in proc.stderr


def test_chat_template_renders_messages_with_the_system_prompt(tmp_path, tokenizer):
    task = DatasetTask(str(_jsonl(tmp_path / "chat.jsonl", ROWS)), prompt_field="q")
    rendered = RenderedTask(task, PromptRenderer(tokenizer, "auto", "Be brief."))
    p = rendered.problems(0, 0, 1)[0]
    content = p.messages[0]["content"]
    assert p.prompt == tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}], tokenize=False,
        add_generation_prompt=True)
    assert p.prompt == f"system: Be brief.\nuser: {content}\nassistant: "  # the tiny model's template
    assert [prompt for prompt, _ in rendered.sft_examples(0, 2)][0].startswith("system: Be brief.\nuser: ")
    plain = RenderedTask(task, PromptRenderer(tokenizer, "none", "Be brief.")).problems(0, 0, 1)[0]
    assert plain.prompt == f"Be brief.\n{content}"
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    custom = RenderedTask(task, PromptRenderer(tokenizer, str(jinja))).problems(0, 0, 1)[0]
    assert custom.prompt == f"<{content}>"


def test_auto_template_without_one_is_refused(tmp_path, tokenizer):
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = None
    task = DatasetTask(str(_jsonl(tmp_path / "chat.jsonl", ROWS)), prompt_field="q")
    with pytest.raises(ConfigError, match="has no chat template"):
        RenderedTask(task, PromptRenderer(tokenizer, "auto")).problems(0, 0, 1)


def test_eval_path_rows_are_the_held_out_problems(tmp_path, tokenizer):
    train = _jsonl(tmp_path / "train.jsonl", ROWS)
    held = _jsonl(tmp_path / "eval.jsonl", [{"q": [{"role": "user", "content": "9+9="}], "answer": "18"}])
    task = RenderedTask(DatasetTask(str(train), prompt_field="q", eval_path=str(held)),
                        PromptRenderer(tokenizer, "auto"))
    got = held_out_problems(task, 0, 5)
    assert [(p.prompt, p.answer) for p in got] == [("user: 9+9=\nassistant: ", "18")]
