"""Train a tiny reward model on synthetic preference pairs of the quickstart task (one-digit sums), for the served
reward model of configs/reward_model.yaml:

    .venv/bin/python scripts/train_reward_model.py [--out runs/reward_model/rm] [--steps 600]

The preference it encodes: an answer that is right and short. For each prompt `a+b=` the chosen completion is the
sum alone; the rejected one is a wrong number, the right sum followed by more characters, or other text. The model
is the quickstart's tiny Qwen2 with a one-label score head (transformers' Qwen2ForSequenceClassification, the layout
of public reward models), trained with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected) (Stiennon et al.
2020, "Learning to summarize from human feedback"; Ouyang et al. 2022), on conversations rendered exactly as the
served model renders them (rollout.reward_model.render_conversation). Prints the pairwise accuracy on pairs drawn
with another seed, and writes the directory `models: {path: ...}` loads. A 20-line loop rather than TRL's
RewardTrainer: it must render as the served scorer does, and the run needs neither datasets nor accelerate.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REJECTED_KINDS = ("wrong", "wrong", "long", "other")  # wrong sums twice as often: the hard part


def preference_pairs(seed: int, n: int) -> list[tuple[str, str, str, str]]:
    """(prompt, chosen, rejected, kind) for one-digit sums: chosen the sum alone."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        right = str(a + b)
        kind = rng.choice(REJECTED_KINDS)
        if kind == "wrong":
            rejected = str(rng.choice([v for v in range(19) if v != a + b]))
        elif kind == "long":
            rejected = right + "".join(rng.choice("0123456789+= ") for _ in range(rng.randint(1, 3)))
        else:
            rejected = "".join(rng.choice("0123456789+=") for _ in range(rng.randint(1, 4)))
            if rejected == right:
                rejected += "0"
        pairs.append((f"{a}+{b}=", right, rejected, kind))
    return pairs


def task_language_model(out: Path, seed: int, lm_steps: int, spec=None) -> Path:
    """The quickstart's tiny Qwen2 taught the task's conversations as a language model (`lm_steps` of next-token
    loss on every one-digit sum, answered right), saved at `out`; the start of the reward model here and of the
    judge (scripts/train_judge.py), as reward models start from a supervised policy (Ouyang et al. 2022): from
    random weights the preference pairs alone did not teach the reward model to tell a wrong sum (0.82 of
    held-out pairs), nor the judge (0.72 of wrong answers judged 0). `spec`: a trainer.tiny_model.TinyModelConfig
    (None: its defaults)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.reward_model import render_conversation
    from rollout.tasks import AdditionTask
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    body = build_tiny_model(out, AdditionTask(1).corpus(), spec or TinyModelConfig(), seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(body)
    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_pretrained(body, dtype=torch.float32)
    seqs = [render_conversation(tokenizer, f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, x in enumerate(seqs):
        ids[i, :len(x)] = labels[i, :len(x)] = torch.tensor(x)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(lm_steps):
        loss = lm(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"language model: {lm_steps} steps, loss {loss.item():.4f}", flush=True)
    lm.save_pretrained(body, safe_serialization=True)
    return body


def build(out: Path, seed: int, lm_steps: int):
    """The reward model before preference training: task_language_model with a one-label score head."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    body = task_language_model(out.with_name(out.name + ".body"), seed, lm_steps)
    tokenizer = AutoTokenizer.from_pretrained(body)
    model = AutoModelForSequenceClassification.from_pretrained(body, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer, body


def _batch(tokenizer, pairs, side: int):
    import torch

    from rollout.reward_model import render_conversation

    seqs = [render_conversation(tokenizer, p[0], p[side]) for p in pairs]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    return ids, mask


def pairwise_accuracy(model, tokenizer, pairs) -> dict[str, float]:
    import torch

    with torch.inference_mode():
        chosen = model(*_batch(tokenizer, pairs, 1)).logits[:, 0]
        rejected = model(*_batch(tokenizer, pairs, 2)).logits[:, 0]
    right = (chosen > rejected).tolist()
    by_kind = {k: [r for r, p in zip(right, pairs) if p[3] == k] for k in dict.fromkeys(REJECTED_KINDS)}
    return {"all": sum(right) / len(right), **{k: sum(v) / max(len(v), 1) for k, v in by_kind.items()}}


def train(out: Path, steps: int, batch: int, lr: float, seed: int, lm_steps: int) -> dict:
    import torch

    torch.manual_seed(seed)
    model, tokenizer, body = build(out, seed, lm_steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    train_pairs, held_out = preference_pairs(seed, steps * batch), preference_pairs(seed + 10_000, 4000)
    t0 = time.perf_counter()
    model.train()
    for step in range(steps):
        pairs = train_pairs[step * batch:(step + 1) * batch]
        chosen = model(*_batch(tokenizer, pairs, 1)).logits[:, 0]
        rejected = model(*_batch(tokenizer, pairs, 2)).logits[:, 0]
        loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()  # Bradley-Terry
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % 100 == 0 or step == steps - 1:
            print(f"step {step + 1}/{steps}  loss {loss.item():.4f}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    model.eval()
    accuracy = pairwise_accuracy(model, tokenizer, held_out)
    report = {"lm_steps": lm_steps, "steps": steps, "batch": batch, "lr": lr, "seed": seed, "final_loss": loss.item(),
              "held_out_pairwise_accuracy": accuracy, "seconds": time.perf_counter() - t0}
    write_model(out, model, tokenizer, "tide_reward_model.json", report, body)
    return report


def write_model(out: Path, model, tokenizer, report_name: str, report: dict, body: Path) -> None:
    """`out` replaced whole by the model, its tokenizer and the training report (written beside, then renamed:
    no half-written directory is ever at `out`); the starting model's directory `body` removed."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / report_name).write_text(json.dumps(report, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    shutil.rmtree(body, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/reward_model/rm"))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lm-steps", type=int, default=300)
    args = parser.parse_args()
    report = train(args.out, args.steps, args.batch, args.lr, args.seed, args.lm_steps)
    print(json.dumps({"out": str(args.out), **report}))


if __name__ == "__main__":
    main()
