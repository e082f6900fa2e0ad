"""A rank's weights written as Hugging Face safetensors shards (the publish phase, `tide export`): converted to HF
names and layout by the model's family (ckpt_transfer/convert/), written by ckpt_transfer's shard writer."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.megatron.rank import MegatronRank


def publish(rank: MegatronRank, out_dir: str, node: str, shard_bytes: int, writer_threads: int = 2,
            adapter: bool = False) -> dict:
    """Convert this rank's weights to HF names and layout and write them as safetensors shards into `out_dir`, its
    node's directory, the records naming `node`. Data-parallel replicas hold the same dense weights (and the
    replicas of an expert-parallel rank the same experts): each writes its share (`replica_share`), so that a
    trainer whose replicas sit on different nodes publishes from all of them and no node writes everything.
    Rank 0 also copies config and tokenizer. `adapter` (trainer.lora): the adapter alone, in PEFT's names, each
    tensor-parallel shard as the base's (no aux files). Returns {"shards": [ShardRecord], "aux_files": [names]}."""
    from ckpt_transfer.convert import family
    from ckpt_transfer.convert.common import replica_share
    from ckpt_transfer.writer import copy_aux_files, write_shards
    from trainer.megatron import lora
    from trainer.megatron.compat import native_torch

    layout = rank.layout()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    aux = copy_aux_files(rank.spec.hf_dir, out_dir) if rank.rank == 0 and not adapter else []
    convert = family(rank.hf_config).megatron_to_hf
    dense_part, expert_part = layout.replica_parts()
    # with adapters, the model published is the base with each adapter merged into its weight (computed only for
    # that publish: merging every adapted weight was 0.23 s of an adapter publish's 0.26 s at ~100M)
    params = [] if adapter else \
        list(lora.merged_parameters(rank.module) if rank.spec.trainer.lora else rank.module.named_parameters())

    def stream_of(part):  # the adapter alone, or the (merged) model
        return lora.peft_tensors(rank.module, part) if adapter else convert(params, rank.hf_config, part)

    with native_torch():  # views only: no device rewriting needed
        stream = replica_share(list(stream_of(dense_part)), layout.dp_rank, layout.dp_size)
        if rank.config.num_moe_experts:
            stream += replica_share(list(stream_of(expert_part)), layout.expert_dp_rank, layout.expert_dp_size)
    if not stream:
        return {"shards": [], "aux_files": aux}
    prefix = f"{'adapter' if adapter else 'model'}-tp{layout.tp_rank:02d}-pp{layout.pp_rank:02d}-ep{layout.ep_rank:02d}"
    if layout.dp_size > 1:  # replicas write files of their own
        prefix += f"-dp{layout.dp_rank:02d}"
    records = write_shards(stream, out_dir, node=node, prefix=prefix, shard_bytes=shard_bytes,
                           dtype=rank.spec.dtype, threads=writer_threads)
    return {"shards": records, "aux_files": aux}
