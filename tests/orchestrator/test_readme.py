"""The README's walkthrough starts as pasted: its data script, reward function and config, written where it says,
give a config that loads, and a reward function that takes TRL's call on that data and scores by hand."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_walkthrough_starts_as_pasted(tmp_path):
    from orchestrator.config.schema import load_config
    from orchestrator.rewards.functions import RewardBatch, RewardFunctions
    from rollout.tasks import make_task

    (script,) = [b for b in _blocks("bash") if "my_task/train.jsonl" in b]
    data_code = script.split("<<'PY'\n", 1)[1].rsplit("PY", 1)[0]
    (tmp_path / "my_task").mkdir()
    subprocess.run([sys.executable, "-c", data_code], cwd=tmp_path, check=True)
    (reward,) = [b for b in _blocks("python") if "def correct(" in b]
    (tmp_path / "my_task" / "rewards.py").write_text(reward)
    (config,) = [b for b in _blocks("yaml") if "name: my_task" in b]
    (tmp_path / "my_task" / "grpo.yaml").write_text(config)

    cfg = load_config(tmp_path / "my_task" / "grpo.yaml", {"iterations": 20, "trainer.lr": 5e-4})
    assert (cfg.iterations, cfg.trainer.lr) == (20, 5e-4)
    task = make_task(cfg.task)
    problem = task.problems(cfg.seed, 1, 1)[0]
    fns = RewardFunctions(cfg.rewards, columns=problem.columns)  # start-up checks: importable, takes the call
    try:
        solution = problem.columns["solution"]
        chat = [list(problem.messages)] * 2
        scored = fns.score_batch(RewardBatch(prompts=chat, completions=[solution, "x"],
                                             columns={"solution": [solution] * 2}, answers=[solution] * 2))
    finally:
        fns.close()
    assert scored.rewards == [1.5, 0.0]  # correct (1) + math (0.5 x 1); neither for "x"
