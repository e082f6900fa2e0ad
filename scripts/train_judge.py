"""Train a tiny generative judge for configs/judge.yaml: the quickstart's tiny Qwen2 taught to read the judge
prompt `{question}{answer}?` (e.g. `3+4=7?`, through its chat template) and reply `1` when the answer is the sum,
right and alone, and `0` otherwise (a wrong number, the sum followed by more, other text):

    .venv/bin/python scripts/train_judge.py [--out runs/judge/model] [--steps 1000]

Supervised next-token loss on the reply's tokens only (the verdict and the end of the turn), on prompts rendered
as the served judge renders them (orchestrator/workers/served_models.py: the template's text as a user turn of the chat
template), starting from the task's language model (train_reward_model.task_language_model). Prints the greedy
verdict's agreement with the rule on examples drawn with another seed (what the judge job's reward means), and
writes the directory `models: {kind: judge, path: ...}` serves. Measured here (~32 s): 0.962 agreement (every
right answer judged 1, 0.93 of the others 0) at 1000 steps of lr 1e-3; 0.91 at 600 steps, 0.87 at 600 steps of
2e-3; 0.85 without the language model first (a larger tiny model, 600 steps of 3e-3)."""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train_reward_model import (REJECTED_KINDS, preference_pairs, task_language_model,  # noqa: E402
                                write_model)

TEMPLATE = "{question}{answer}?"  # configs/judge.yaml's


def examples(seed: int, n: int) -> list[tuple[str, str, str]]:
    """(prompt, answer, verdict): half right answers (verdict 1), half of the reward model's rejected kinds (0)."""
    rng = random.Random(seed)
    out = []
    for prompt, chosen, rejected, _ in preference_pairs(seed, n):
        out.append((prompt, chosen, "1") if rng.random() < 0.5 else (prompt, rejected, "0"))
    return out


def _problem(prompt: str, answer: str):
    """The judge's prompt as the served judge renders it (orchestrator/workers/served_models.py): the template's
    text as a user turn, for the policy's prompt renderer."""
    from rollout.judge import judge_problem, render

    return judge_problem(render(TEMPLATE, prompt, answer, None, []), True)


def _prompt_ids(renderer, prompt: str, answer: str) -> list[int]:
    rendered, _ = renderer.render(_problem(prompt, answer))
    return list(rendered.prompt_ids)


def _batch(renderer, rows):
    import torch

    tokenizer = renderer.tokenizer
    seqs, starts = [], []
    for prompt, answer, verdict in rows:
        ids = _prompt_ids(renderer, prompt, answer)
        reply = renderer.completion_ids(_problem(prompt, answer), verdict)  # the verdict, then the end of turn
        seqs.append(ids + reply)
        starts.append(len(ids))
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, (s, start) in enumerate(zip(seqs, starts)):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
        labels[i, start:len(s)] = torch.tensor(s[start:])  # the reply's tokens only
    return ids, mask, labels


def agreement(model, renderer, rows) -> dict[str, float]:
    """Share of `rows` whose greedy first reply token is the rule's verdict, overall and by kind of answer."""
    import torch

    right = []
    for prompt, answer, verdict in rows:
        ids = torch.tensor([_prompt_ids(renderer, prompt, answer)])
        with torch.inference_mode():
            token = int(model(input_ids=ids).logits[0, -1].argmax())
        right.append(renderer.tokenizer.decode([token]) == verdict)
    ones = [r for r, row in zip(right, rows) if row[2] == "1"]
    zeros = [r for r, row in zip(right, rows) if row[2] == "0"]
    return {"all": sum(right) / len(right), "right_answers": sum(ones) / max(len(ones), 1),
            "other_answers": sum(zeros) / max(len(zeros), 1)}


def train(out: Path, steps: int, batch: int, lr: float, seed: int, lm_steps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchestrator.workers.prompts import PromptRenderer
    from trainer.tiny_model import TinyModelConfig

    # the quickstart's sizes: vLLM, which serves the judge, has CPU attention kernels for head sizes of 32 and up
    spec = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    body = task_language_model(out.with_name(out.name + ".init"), seed, lm_steps, spec)
    tokenizer = AutoTokenizer.from_pretrained(body)
    renderer = PromptRenderer(tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(body, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rows, held_out = examples(seed, steps * batch), examples(seed + 10_000, 1000)
    t0 = time.perf_counter()
    model.train()
    for step in range(steps):
        ids, mask, labels = _batch(renderer, rows[step * batch:(step + 1) * batch])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % 100 == 0 or step == steps - 1:
            print(f"step {step + 1}/{steps}  loss {loss.item():.4f}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    model.eval()
    report = {"lm_steps": lm_steps, "steps": steps, "batch": batch, "lr": lr, "seed": seed, "final_loss": loss.item(),
              "held_out_agreement": agreement(model, renderer, held_out), "template": TEMPLATE,
              "answer_kinds": sorted(set(REJECTED_KINDS)), "seconds": time.perf_counter() - t0}
    write_model(out, model, tokenizer, "tide_judge.json", report, body)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/judge/model"))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lm-steps", type=int, default=300, help="the task's language model first "
                        "(train_reward_model.task_language_model)")
    args = parser.parse_args()
    report = train(args.out, args.steps, args.batch, args.lr, args.seed, args.lm_steps)
    print(json.dumps({"out": str(args.out), **report}))


if __name__ == "__main__":
    main()
