"""LLM judges (`models: {kind: judge}`; rollout/judge.py, orchestrator/workers/served_models.py): templates refused
by name, verdicts read as numbers, letters or JSON fields (None where none can be read, never a guess), and a
served judge whose values are its replies read by the parser, unreadable ones counted and given the configured
reward, identical prompts judged once."""
from __future__ import annotations

import re

import pytest

from orchestrator.config.schema import ConfigError, parse_config
from rollout.judge import JudgeTemplateError, check_template, parse_verdict, render


@pytest.mark.parametrize("text, verdict, options, want", [
    ("Score: 7", "number", {}, 7.0),
    ("The score is 7.", "number", {}, 7.0),
    ("I count 3 errors. Final score: 8/10", "number", {}, 8.0),  # the last number written; 8/10 is an 8
    ("Score: 8 / 10", "number", {"scale": (0, 10)}, 0.8),
    ("Final score: 8", "number", {"scale": (0, 10)}, 0.8),
    ("score 11", "number", {"scale": (0, 10)}, None),  # outside the scale: unreadable, not clipped
    ("-2.5", "number", {}, -2.5),
    ("no number here", "number", {}, None),
    ("x1 and v2.0.1", "number", {}, None),  # digits inside words and versions are not verdicts
    ("My verdict: [[A]]", "letter", {"letters": {"A": 1.0, "B": 0.0}}, 1.0),
    ("A is tempting, but B", "letter", {"letters": {"A": 1.0, "B": 0.0}}, 0.0),  # the last letter written
    ("BAD", "letter", {"letters": {"A": 1.0, "B": 0.0}}, None),  # inside a word
    ('{"score": 0.5} then {"score": 0.75, "why": "ok"}', "json", {}, 0.75),
    ('{"grade": 3}', "json", {"key": "grade"}, 3.0),
    ('{"score": "high"}', "json", {}, None),
    ('{"score": true}', "json", {}, None),
    ("{broken", "json", {}, None),
])
def test_verdicts_are_read_or_refused(text, verdict, options, want):
    assert parse_verdict(text, verdict, **options) == want


def test_templates_render_and_name_what_is_wrong():
    check_template("Q: {question}\nA: {answer}\nRef: {reference}\n{rubric}")
    text = render("Q: {question} A: {answer} R: {reference}\n{rubric}", [{"role": "system", "content": "s"},
                  {"role": "user", "content": "2+2="}], "4", 4, ["right", "short"])
    assert text == "Q: 2+2= A: 4 R: 4\n- right\n- short"
    with pytest.raises(JudgeTemplateError, match=r"unknown field \{respone\}"):
        check_template("{question} {respone}")
    with pytest.raises(JudgeTemplateError, match="never shows the judge the {answer}"):
        check_template("{question}")
    with pytest.raises(JudgeTemplateError, match="a literal brace is written"):
        check_template("{answer} {")


def test_judge_config_checks(tiny_model_dir):
    base = {"name": "t", "iterations": 1, "rewards": [{"model": "j"}]}

    def judge(**fields):
        return parse_config({**base, "models": {"j": {"kind": "judge", "path": str(tiny_model_dir), **fields}}})

    cfg = judge(template="{question}{answer}?", verdict="letter", letters={"Y": 1, "N": 0})
    assert cfg.models["j"].letters == {"Y": 1.0, "N": 0.0} and cfg.models["j"].unreadable_reward is None
    for fields, message in [({}, "kind judge needs a `template`"),
                            ({"template": "{answer} {bogus}"}, "unknown field {bogus}"),
                            ({"template": "{answer}", "verdict": "letter"}, "verdict letter needs `letters`"),
                            ({"template": "{answer}", "scale": [1, 0]}, "scale [1.0, 0.0]: lo must be below hi")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            judge(**fields)
    with pytest.raises(ConfigError, match=re.escape("template: a judge's setting; this model's kind is reward_model")):
        parse_config({**base, "models": {"j": {"path": str(tiny_model_dir), "template": "{answer}"}}})


def test_a_served_judge_is_its_replies_read_counted_and_cached(ray_cluster, tiny_model_dir):
    """A random tiny judge: what it writes means nothing, so the test checks the plumbing: each value is the
    parser's reading of the reply kept for that sample (or unreadable_reward), unreadable replies are counted,
    and a prompt judged before is not sent again."""
    from orchestrator.workers.served_models import ServedModels
    from orchestrator.rewards.served_config import ServedModelConfig

    cfg = ServedModelConfig(kind="judge", path=str(tiny_model_dir), template="{question}{answer}?",
                            verdict="number", unreadable_reward=-1.0, max_new_tokens=6)
    served = ServedModels({"judge": cfg})
    try:
        judge = served["judge"]
        prompts = [f"{a}+{b}=" for a in range(4) for b in range(4)]
        completions = [str((a * b) % 10) for a in range(4) for b in range(4)]
        values = judge.score(prompts, completions, [None] * len(prompts))
        replies = judge.last_replies
        assert len(replies) == len(prompts) and any(replies)
        read = [parse_verdict(r, "number") for r in replies]
        assert values == [-1.0 if v is None else v for v in read]
        assert served.metrics()["served/judge/unreadable"] == sum(v is None for v in read)
        assert judge.cache_hits == 0
        again = judge.score(prompts[:5] + prompts[:5], completions[:5] + completions[:5])
        assert again == values[:5] * 2 and judge.last_replies == replies[:5] * 2
        assert judge.cache_hits == 10  # nothing sent to the engine
    finally:
        served.close()
