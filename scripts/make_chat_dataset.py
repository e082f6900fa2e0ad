"""Writes the small chat-format dataset of `configs/chat_dataset.yaml`: single-digit sums and differences asked
as a user message, with the answer and the operands as columns (generated here, never downloaded).

    python scripts/make_chat_dataset.py [--out data/chat_arith] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rows(rng: random.Random, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        op = rng.choice("+-")
        a, b = (a, b) if op == "+" or a >= b else (b, a)
        out.append({"messages": [{"role": "user", "content": f"{a}{op}{b}="}],
                    "answer": str(a + b if op == "+" else a - b), "a": a, "b": b, "op": op})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "data" / "chat_arith")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--eval", type=int, default=200)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", args.train), ("eval", args.eval)):
        path = args.out / f"{name}.jsonl"
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows(rng, n)))
        tmp.replace(path)
        print(f"wrote {path} ({n} rows)")


if __name__ == "__main__":
    main()
