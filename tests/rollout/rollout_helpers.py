"""Helpers for the rollout tests: iterations shaped like a publish, and a transformers reference."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ckpt_transfer.manifest import Manifest, ShardRecord, TensorRecord

WEIGHTS = "model.safetensors"


def publish_like(src: Path, directory: Path, iteration: int,
                 transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None, run: str = "test") -> Manifest:
    """Write `src`'s weights (optionally transformed) as one whole-tensor shard plus config and tokenizer
    files into `directory`, with a manifest, the way publish lays out an iteration."""
    from safetensors.torch import load_file, save_file

    from ckpt_transfer.checksum import checksum_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / WEIGHTS))
    if transform is not None:
        tensors = {name: transform(name, t).contiguous() for name, t in tensors.items()}
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
    aux = sorted(p.name for p in src.iterdir() if p.is_file() and p.suffix in (".json", ".jinja")
                 and p.name != "manifest.json")
    for name in aux:
        shutil.copyfile(src / name, directory / name)
    shard = ShardRecord(
        file=WEIGHTS, node="local", nbytes=(directory / WEIGHTS).stat().st_size,
        checksum=checksum_file(directory / WEIGHTS),
        tensors=tuple(TensorRecord(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()),
    )
    manifest = Manifest(run=run, iteration=iteration, directory=str(directory), shards=[shard], aux_files=aux)
    manifest.save()
    return manifest


def perturb(seed: int, scale: float) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """Adds seeded Gaussian noise to every matrix: a checkpoint that clearly changes the model's outputs."""
    def apply(name: str, t: torch.Tensor) -> torch.Tensor:
        if t.dim() < 2:
            return t
        g = torch.Generator().manual_seed(seed + sum(map(ord, name)))
        return t + scale * torch.randn(t.shape, generator=g, dtype=t.dtype)
    return apply


class HFReference:
    """Teacher-forced log-probs from transformers on an HF directory (float32)."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    @torch.no_grad()
    def logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
        logits = self.model(ids).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        start = len(prompt_ids)
        return [lp[start + i - 1, tok].item() for i, tok in enumerate(completion_ids)]


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max((abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)), default=0.0)


@dataclass(frozen=True)
class Turn:
    """A scripted model turn: its text, the ids sampled for it (default: the text encoded, then the end of the
    turn unless the token limit cut it) and why it ended."""

    text: str
    ids: tuple[int, ...] | None = None
    finish: str = "stop"


def scripted_generate(tokenizer, script: dict[int, list], end_of_turn: int | None = None):
    """A stand-in for the engine's sampling in agent-loop tests: trajectory i's turns are `script[i]` in order (a
    text, or a Turn), tokenised and ended with `end_of_turn` (default: the end-of-sequence token) as a sampled turn
    would be."""
    from collections import Counter

    from rollout.samples import Sample, Samples

    turns = Counter()
    end = tokenizer.eos_token_id if end_of_turn is None else end_of_turn

    def generate(problems, max_new, seed):
        items = []
        for p in problems:
            i = int(p.task_id)
            turn = script[i][turns[i]]
            turns[i] += 1
            turn = turn if isinstance(turn, Turn) else Turn(turn)
            ids = list(turn.ids) if turn.ids is not None else tokenizer.encode(turn.text, add_special_tokens=False) + (
                [end] if turn.finish == "stop" else [])
            items.append(Sample(prompt_index=0, task_id=p.task_id, prompt_ids=list(p.prompt_ids), completion_ids=ids,
                                logprobs=[-0.1] * len(ids), text=turn.text, finish_reason=turn.finish))
        return Samples(items)
    return generate


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml_tokenizer():
    """A byte-level BPE tokenizer with merges (words are single tokens) and ChatML's special tokens, with a ChatML
    template: what Qwen's tokenizers look like, small."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["hello world", "the tool said 42", "user assistant system tool", "print the answer", "tool_call"]
    tok.train_from_iterator(corpus * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=specials[1:])
    fast.chat_template = CHATML
    return fast


def python_episodes(client, n: int, counts, timeout_s: float = 30, **session) -> list:
    """`n` tool conversations with the built-in python tool, each on a sandbox session of its own (`session`:
    PythonSession's ttl_s, cell_timeout_s), the session its episode's resource."""
    from rollout.agent import HermesParser, PythonSession, ToolBox, ToolEpisode

    out = []
    for i in range(n):
        py = PythonSession(client, limits={"output_kb": 16}, **session)
        out.append(ToolEpisode([{"role": "user", "content": f"task {i}"}], HermesParser(),
                               ToolBox([py.tool()], timeout_s=timeout_s, max_chars=4000), counts, [py]))
    return out
