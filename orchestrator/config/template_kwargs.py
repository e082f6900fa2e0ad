"""`model.chat_template_kwargs`: variables handed to the chat template (transformers' `apply_chat_template(...,
**kwargs)`) wherever tide renders messages -- rollout prompts, agent trajectories, evaluation, the warm start's
examples and demonstrations, the log-prob probe -- such as Qwen3's `enable_thinking: false`. The arguments tide sets
itself on every rendering, and apply_chat_template's own parameters (which never reach the template), are refused
by name."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator

# apply_chat_template's parameters and the template's own variables, with what tide sets them to
_MESSAGES = "the messages rendered: a problem's prompt, an agent's conversation"
_TURN = "true where a prompt ends, false after a finished turn"
_TOKENS = "the rendered text is tokenised by tide"
_LENGTH = "prompts are cut by rollout.max_prompt_tokens and rollout.overlong_prompts"
_TIDE_SETS = {
    "conversation": _MESSAGES, "messages": _MESSAGES, "tools": "the agent's tool schemas, from agent.tools",
    "documents": "none, transformers' retrieval documents", "chat_template": "model.chat_template",
    "add_generation_prompt": _TURN, "continue_final_message": _TURN,
    "tokenize": _TOKENS, "return_dict": _TOKENS, "return_tensors": _TOKENS, "return_assistant_tokens_mask": _TOKENS,
    "padding": _TOKENS, "tokenizer_kwargs": _TOKENS, "truncation": _LENGTH, "max_length": _LENGTH,
}


def checked(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` as given; a ValueError naming every key tide sets itself."""
    taken = [key for key in kwargs if key in _TIDE_SETS]
    if taken:
        reasons = "; ".join(f"model.chat_template_kwargs.{key}: tide sets it itself ({_TIDE_SETS[key]})"
                            for key in taken)
        raise ValueError(f"{reasons}. Remove {'it' if len(taken) == 1 else 'them'}: only the template's own "
                         f"variables (enable_thinking, ...) are passed through")
    return kwargs


ChatTemplateKwargs = Annotated[dict[str, Any], AfterValidator(checked)]
