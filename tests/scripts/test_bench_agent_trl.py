"""scripts/bench_agent_trl.py's TRL set-up on the tiny model's template: TRL reads back, as OpenAI tool calls, the
calls tide's hermes parser writes, and renders a conversation's calls where tide's demonstrations write them."""
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture
def trl_tokenizer(tiny_model_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    sys.modules.pop("bench_agent_trl", None)
    import bench_agent_trl
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = tok.chat_template
    tok.chat_template = bench_agent_trl.hermes_chat_template(plain)
    tok.response_template = bench_agent_trl.hermes_response_template(bench_agent_trl.generation_prompt(tok),
                                                                     tok.eos_token)
    return tok, plain


def test_trl_parses_the_calls_tide_writes_and_nothing_else(trl_tokenizer):
    from trl.chat_template_utils import parse_response

    from rollout.agent import ToolCall, get_parser

    tok, _ = trl_tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "6*7="}], add_generation_prompt=True,
                                     return_dict=True)["input_ids"]
    call = get_parser("hermes").format([ToolCall("python", {"code": "print(6*7)"})])

    def parsed(text: str) -> dict:
        return parse_response(tok, tok(text + tok.eos_token, add_special_tokens=False)["input_ids"], prefix=prompt)

    assert parsed(call)["tool_calls"] == [{"type": "function",
                                           "function": {"name": "python", "arguments": {"code": "print(6*7)"}}}]
    assert parsed("42") == {"role": "assistant", "content": "42"}
    broken = '<tool_call>{"name": "python", "arguments": </tool_call>'
    assert "tool_calls" not in parsed(broken) and parsed(broken)["content"] == broken


def test_the_template_writes_calls_as_tide_does_and_everything_else_as_before(trl_tokenizer):
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    from rollout.agent import ToolCall, get_parser

    tok, plain = trl_tokenizer
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)
    call = {"type": "function", "function": {"name": "python", "arguments": {"code": "print(6*7)"}}}
    messages = [{"role": "user", "content": "6*7="}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "python", "content": "42"}, {"role": "assistant", "content": "42"}]
    written = get_parser("hermes").format([ToolCall("python", {"code": "print(6*7)"})])
    tide_form = [*messages[:1], {"role": "assistant", "content": written}, *messages[2:]]
    assert tok.apply_chat_template(messages, tokenize=False) == tok.apply_chat_template(
        tide_form, tokenize=False, chat_template=plain)
    assert tok.apply_chat_template(tide_form, tokenize=False) == tok.apply_chat_template(
        tide_form, tokenize=False, chat_template=plain)
