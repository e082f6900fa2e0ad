"""Users' functions are found one way, tools as reward functions (rollout/user_functions.py): a file relative to
the config's directory, or a module importable from the config's directory or the working directory; the resolved
config names them so that a run resumed from another directory, in a fresh process, finds them again; errors name
the spec, the file or module and why."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from orchestrator.config.schema import dump_config, load_config
from rollout.agent import load_tool

CALC = '''
def calculator(a: int, b: int) -> int:
    """Multiplies two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a * b


def score(completions, **kwargs):
    return [float(c == "12") for c in completions]
'''


@pytest.fixture
def fresh_imports(tmp_path):
    """The modules imported from the test's files, and the path entries added, are dropped again (as if the next
    load were in a new process)."""
    path = list(sys.path)

    def forget() -> None:
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)) or name == "my_task":
                del sys.modules[name]
        sys.path[:] = path
    yield forget
    forget()


@pytest.fixture
def project(tmp_path, monkeypatch):
    """proj/my_task/{calc_tools.py, <configs>}, the working directory proj/ (as the issue's user had it)."""
    (tmp_path / "proj" / "my_task").mkdir(parents=True)
    (tmp_path / "proj" / "my_task" / "calc_tools.py").write_text(CALC)
    monkeypatch.chdir(tmp_path / "proj")
    return tmp_path / "proj"


def _config(project: Path, **sections) -> Path:
    path = project / "my_task" / "c.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "iterations": 1, "task": {"name": "multiply"}, **sections}))
    return path


@pytest.mark.parametrize("spec, resolved", [
    ("calc_tools.py:calculator", "{proj}/my_task/calc_tools.py:calculator"),  # a file beside the config
    ("calc_tools:calculator", "{proj}/my_task/calc_tools:calculator"),  # a module beside the config
    ("my_task.calc_tools:calculator", "{proj}/my_task.calc_tools:calculator"),  # one in the working directory
    ("../my_task/calc_tools.py:calculator", "{proj}/my_task/calc_tools.py:calculator"),
])
def test_a_tool_is_found_beside_the_config_and_again_on_resume_from_elsewhere(project, tmp_path, monkeypatch,
                                                                             fresh_imports, spec, resolved):
    cfg = load_config(_config(project, agent={"tools": [spec]}))
    assert cfg.agent.tools == [resolved.format(proj=project)]
    assert load_tool(cfg.agent.tools[0]).fn(a=3, b=4) == 12
    run_dir = tmp_path / "runs" / "t"  # `tide resume` reads RUN_DIR/config.yaml, from any directory
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    fresh_imports()
    monkeypatch.chdir(tmp_path / "runs")
    again = load_config(run_dir / "config.yaml")
    assert again.agent.tools == cfg.agent.tools
    assert load_tool(again.agent.tools[0]).fn(a=3, b=4) == 12


def test_a_reward_function_is_found_as_a_tool_is_in_its_worker_process(project, tmp_path, monkeypatch,
                                                                       fresh_imports):
    from orchestrator.rewards.functions import RewardFunctions

    cfg = load_config(_config(project, rewards=[{"fn": "calc_tools:score"}]))
    assert cfg.rewards[0].fn == f"{project}/my_task/calc_tools:score"
    fresh_imports()
    monkeypatch.chdir(tmp_path)  # neither the config's directory nor proj/
    fns = RewardFunctions(cfg.rewards)
    try:
        assert fns.score(["p", "p"], ["12", "7"], {}).rewards == [1.0, 0.0]
    finally:
        fns.close()


@pytest.mark.parametrize("spec, message", [
    ("nope.py:calculator", r"tool '{d}/nope.py:calculator': no such file {d}/nope.py"),
    ("calc_tools.py:nope", r"tool '{d}/calc_tools.py:nope': {d}/calc_tools.py has no function 'nope'"),
    ("calc_tools:nope", r"tool '{d}/calc_tools:nope': calc_tools has no function 'nope'"),
    ("broken.py:f", r"tool '{d}/broken.py:f': cannot import {d}/broken.py: RuntimeError: at import \(raised by "
                    r"the module's own code\)"),
    ("missing_dep:f", r"cannot import missing_dep: ModuleNotFoundError: No module named 'no_such_module_xyz' "
                      r"\(raised by the module's own code\)"),
    ("no_such_module_xyz:f", r"tool 'no_such_module_xyz:f': cannot import no_such_module_xyz: ModuleNotFoundError: "
                             r"No module named 'no_such_module_xyz' \(looked in the installed packages, the working "
                             r"directory {proj}"),
])
def test_what_cannot_be_loaded_is_named_with_why(project, fresh_imports, spec, message):
    d = project / "my_task"
    (d / "broken.py").write_text("raise RuntimeError('at import')\n")
    (d / "missing_dep.py").write_text("import no_such_module_xyz\n")
    cfg = load_config(_config(project, agent={"tools": [spec]}))
    with pytest.raises(ValueError, match=message.format(d=d, proj=project)):
        load_tool(cfg.agent.tools[0])


def test_a_tool_without_a_described_signature_names_its_spec(project, fresh_imports):
    (project / "my_task" / "bare.py").write_text(textwrap.dedent('''
        def bare(x):
            return x
    '''))
    cfg = load_config(_config(project, agent={"tools": ["bare.py:bare"]}))
    with pytest.raises(ValueError, match=r"'.*/my_task/bare.py:bare': tool 'bare' cannot be declared to the model"):
        load_tool(cfg.agent.tools[0])
