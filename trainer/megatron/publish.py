"""A rank's weights written as Hugging Face safetensors shards (the publish phase, `tide export`): converted to HF
names and layout by the model's family (ckpt_transfer/convert/), written by ckpt_transfer's shard writer."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.megatron.rank import MegatronRank


def publish(rank: MegatronRank, out_dir: str, node: str, shard_bytes: int, writer_threads: int = 2) -> dict:
    """Convert this rank's weights to HF names and layout and write them as safetensors shards.
    Data-parallel replicas do not write: dense weights come from data-parallel rank 0, experts from
    expert-data-parallel rank 0 of each expert-parallel rank. Rank 0 also copies config and tokenizer.
    Returns {"shards": [ShardRecord], "aux_files": [names]}."""
    from ckpt_transfer.convert import family
    from ckpt_transfer.writer import copy_aux_files, write_shards
    from trainer.megatron.compat import native_torch

    layout = rank.layout()
    aux: list[str] = []
    if rank.rank == 0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        aux = copy_aux_files(rank.spec.hf_dir, out_dir)
    if not (layout.writes_dense or (rank.config.num_moe_experts and layout.writes_experts)):
        return {"shards": [], "aux_files": aux}
    with native_torch():  # views only: no device rewriting needed
        stream = list(family(rank.hf_config).megatron_to_hf(rank.module.named_parameters(), rank.hf_config, layout))
    prefix = f"model-tp{layout.tp_rank:02d}-pp{layout.pp_rank:02d}-ep{layout.ep_rank:02d}"
    records = write_shards(stream, out_dir, node=node, prefix=prefix, shard_bytes=shard_bytes,
                           dtype=rank.spec.dtype, threads=writer_threads)
    return {"shards": records, "aux_files": aux}
