"""docs/agents.md's own-tool example as pasted: its tool file, data script and config, written where it says, load;
the tool is found beside the config and built as a run builds it, the dataset's demonstrations pass the start-up
check, and a demonstration played through the agent loop calls the real tool and is laid out token for token as
the warm start lays the written one out."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _block(language: str, marker: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", (ROOT / "docs" / "agents.md").read_text(), flags=re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


def test_the_own_tool_example_runs_as_written(tmp_path, monkeypatch, tiny_model_dir):
    from transformers import AutoTokenizer

    from orchestrator.agents.agent_rollout import Agent
    from orchestrator.config.schema import load_config
    from orchestrator.workers.prompts import PromptRenderer, RenderedTask
    from orchestrator.iteration.warmup import check_demonstrations, written_conversations
    from rollout.tasks import Problem, make_task
    from tests.rollout.rollout_helpers import scripted_generate

    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # `python`: this environment's
    subprocess.run(["bash", "-c", _block("bash", "my_task/products.jsonl")], cwd=tmp_path, check=True,
                   env={**os.environ, "PATH": path})
    (tmp_path / "my_task" / "calc_tools.py").write_text(_block("python", "def calculator("))
    (tmp_path / "my_task" / "tool.yaml").write_text(_block("yaml", "name: my_tool"))
    monkeypatch.chdir(tmp_path)  # `tide run my_task/tool.yaml` from the directory holding my_task/

    cfg = load_config(Path("my_task/tool.yaml"))
    assert cfg.agent.tools == [f"{tmp_path / 'my_task' / 'calc_tools.py'}:calculator"]  # absolute when resolved
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    renderer = PromptRenderer(tokenizer, cfg.model.chat_template, cfg.model.system_prompt,
                              cfg.rollout.max_prompt_tokens, cfg.rollout.overlong_prompts)
    task = RenderedTask(make_task(cfg.task, seed=cfg.seed), renderer)
    agent = Agent(cfg.agent, tokenizer, renderer.template, cfg.model.system_prompt, cfg.rollout.max_new_tokens,
                  None, cfg.task.name, deterministic=cfg.deterministic)
    assert [t.name for t in agent.user_tools] == ["calculator"]
    check_demonstrations(task, cfg.trainer, cfg.seed, agent)  # every row calls the tool as it takes calls

    conversation = written_conversations(task, cfg.trainer, cfg.seed)[0]
    (demo,) = agent.demonstrations([conversation], renderer.end_of_turn_ids())
    call_text = agent._as_written(conversation[1])["content"]
    assert call_text.startswith("<tool_call>") and '"name": "calculator"' in call_text
    prompt = conversation[0]["content"]
    problem = Problem("0", prompt, conversation[-1]["content"], messages=(conversation[0],))
    played = agent.rollout(scripted_generate(tokenizer, {0: [call_text, conversation[-1]["content"]]}), [problem],
                           1, seed=0, version=0)
    s = played.samples.items[0]
    a, b = map(int, prompt.rstrip("=").split("*"))
    assert [m["content"] for m in s.conversation if m["role"] == "tool"] == [str(a * b)]  # the real tool answered
    assert played.metrics["tools/call_frequency"] == 1 and played.metrics["tools/failure_frequency"] == 0
    assert demo.prompt_ids == s.prompt_ids and demo.completion_ids == s.completion_ids
    assert demo.loss_mask == [float(m) for m in s.loss_mask]
