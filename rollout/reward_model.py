"""A sequence-classification reward model scoring (prompt, completion) pairs: the layout of public reward models
(transformers' `AutoModelForSequenceClassification` with one label, as Skywork-Reward, InternLM2-Reward or TRL's
RewardTrainer outputs), whose score is the head's logit at the conversation's last token.

The conversation is rendered with the reward model's own tokenizer and chat template (a user turn with the prompt,
or the prompt's messages, then an assistant turn with the completion), as these models are scored on their model
cards; a tokenizer without a chat template gets the prompt's text followed by the completion's. Inputs longer than
the model's context are refused, never truncated: a truncated conversation would be scored on what was left.

This module holds the model alone; orchestrator/workers/served_models.py serves it for a run (Ray actors, batching
across replicas, replacement and timeouts)."""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def render_conversation(tokenizer, prompt: str | list[dict[str, Any]], completion: str) -> list[int]:
    """Token ids of the conversation a reward model scores (and is trained on: scripts/train_reward_model.py)."""
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": completion}],
                                            tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    text = "\n".join(str(m["content"]) for m in messages) if isinstance(prompt, list) else prompt
    return tokenizer(text + completion, add_special_tokens=True).input_ids


class RewardModelError(RuntimeError):
    """A reward model that cannot be loaded, or an input it cannot score; the message names the model."""


class RewardModel:
    """Loads `path` (a Hugging Face directory) on `device` in `dtype`; `score` rates pairs, `batch_size` at a
    time, batched by length (each batch padded to its longest; the attention mask keeps the padding out of every
    score)."""

    def __init__(self, name: str, path: str, device: str = "cpu", dtype: str = "float32", batch_size: int = 32,
                 threads: int | None = None) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        self.name, self.path, self.batch_size = name, path, batch_size
        if threads:
            torch.set_num_threads(threads)
        if not (Path(path) / "config.json").is_file():
            raise RewardModelError(f"reward model {name!r}: {path} holds no config.json (a Hugging Face model "
                                   f"directory is needed)")
        config = AutoConfig.from_pretrained(path)
        if getattr(config, "num_labels", 1) != 1:
            raise RewardModelError(f"reward model {name!r}: {path} has {config.num_labels} labels; a reward model "
                                   f"has one (its score)")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=getattr(torch, dtype)).to(device).eval()
        if self.model.config.pad_token_id is None:  # transformers pools at the last token that is not padding
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device
        self.context = int(getattr(config, "max_position_embeddings", 0) or 0)

    def render(self, prompt: str | list[dict[str, Any]], completion: str) -> list[int]:
        return render_conversation(self.tokenizer, prompt, completion)

    def score(self, prompts: Sequence[str | list[dict[str, Any]]], completions: Sequence[str]) -> list[float]:
        import torch

        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        rendered = [self.render(p, c) for p, c in zip(prompts, completions)]
        too_long = [i for i, ids in enumerate(rendered) if self.context and len(ids) > self.context]
        if too_long:
            i = too_long[0]
            raise RewardModelError(f"reward model {self.name!r}: {len(too_long)} conversation(s) longer than its "
                                   f"context of {self.context} tokens (the first: {len(rendered[i])} tokens, "
                                   f"completion {completions[i][:80]!r}); they are refused, not truncated")
        scores = [0.0] * len(rendered)
        pad = self.tokenizer.pad_token_id
        # batches of similar lengths (longest first), each padded to its longest: less padding computed than in
        # the given order; scores go back to their conversations' places
        order = sorted(range(len(rendered)), key=lambda i: -len(rendered[i]))
        for lo in range(0, len(order), self.batch_size):
            places = order[lo:lo + self.batch_size]
            chunk = [rendered[i] for i in places]
            width = max(len(ids) for ids in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, seq in enumerate(chunk):  # right padding: the pooled last token is each row's own
                ids[row, :len(seq)] = torch.tensor(seq)
                mask[row, :len(seq)] = 1
            with torch.inference_mode():
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            for i, x in zip(places, logits[:, 0].float().cpu().tolist()):
                scores[i] = float(x)
        return scores

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "pid": os.getpid(), "context": self.context}
