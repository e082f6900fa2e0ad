"""Shard manifest: the contract between publish (trainer side) and sync (rollout side).

Plain dataclasses with JSON round-trips; importing this module must not import torch, vLLM or Ray.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST_FILE = "manifest.json"
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")  # PEFT's names of a LoRA adapter's tensors


@dataclass(frozen=True)
class TensorRecord:
    """One tensor inside a safetensors shard: whole (tp_dim None), or shard tp_rank of tp_size along tp_dim, which
    the engines' directory concatenates in order. A shard is a TP shard, or an expert-parallel rank's block of a
    checkpoint tensor that stacks a layer's experts (gpt_oss)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    tp_rank: int = 0
    tp_size: int = 1
    tp_dim: int | None = None


@dataclass(frozen=True)
class ShardRecord:
    """A safetensors file in shared memory. offset/nbytes locate the file's bytes within the node's
    registered buffer (a whole file is one buffer, so offset is 0 unless a transport packs files)."""

    file: str
    node: str
    nbytes: int
    checksum: str
    tensors: tuple[TensorRecord, ...]
    offset: int = 0

    @classmethod
    def from_dict(cls, d: dict) -> "ShardRecord":
        tensors = tuple(
            TensorRecord(**{**t, "shape": tuple(t["shape"])}) for t in d["tensors"]
        )
        return cls(**{**d, "tensors": tensors})


@dataclass
class Manifest:
    """Everything a rollout node needs to load iteration `iteration` of run `run`."""

    run: str
    iteration: int
    directory: str
    shards: list[ShardRecord] = field(default_factory=list)
    aux_files: list[str] = field(default_factory=list)  # config.json, tokenizer files (replicated)
    tp_size: int = 1

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def is_whole(self) -> bool:
        """Every tensor whole (a shard of one is the tensor): the directory loads as an HF checkpoint as is."""
        return self.tp_size == 1 and all(t.tp_dim is None or t.tp_size == 1 for s in self.shards for t in s.tensors)

    @property
    def is_adapter(self) -> bool:
        """A LoRA adapter's tensors alone (trainer.lora's adapter publish: PEFT names, no config or tokenizer files),
        to be served on a base model rather than loaded as one."""
        names = [t.name for s in self.shards for t in s.tensors]
        return bool(names) and all(n.endswith(ADAPTER_SUFFIXES) for n in names)

    def to_json(self) -> str:
        # Built by hand: dataclasses.asdict deep-copies every field (2 ms for a 100M-parameter model's
        # manifest); compact separators keep json on its C encoder.
        d = {**vars(self), "shards": [{**vars(s), "tensors": [vars(t) for t in s.tensors]} for s in self.shards]}
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        d = json.loads(text)
        d["shards"] = [ShardRecord.from_dict(s) for s in d["shards"]]
        return cls(**d)

    @classmethod
    def load(cls, directory: str | Path) -> "Manifest":
        return cls.from_json((Path(directory) / MANIFEST_FILE).read_text())

    def save(self, directory: str | Path | None = None) -> Path:
        """Atomic write: a reader never sees a half-written manifest."""
        path = Path(directory or self.directory) / MANIFEST_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)
        return path
