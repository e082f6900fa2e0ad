"""`tide plan CONFIG`: whether a config's trainer ranks and engines fit the memory they get, from the model's
shape and the config alone (nothing is run): per trainer rank trainer/memory_plan.py's figures, per engine
rollout/memory_plan.py's, against a GPU's memory on cuda or the host's RAM on cpu (where every rank, engine and the
driver share one node), and when something does not fit, the smallest change of the config that makes it fit.
With placement.trainer_nodes > 1: each node's ranks and its share of the published checkpoint (trainer/node_plan.py)
against its shared memory (--shm-gb)."""
from __future__ import annotations

import os
from dataclasses import asdict
from typing import Literal

from pydantic import BaseModel

from orchestrator.config.schema import TideConfig
from rollout.memory_plan import EngineMemory, engine_memory
from trainer.memory_plan import DTYPE_BYTES, GiB, ModelShape, RankMemory, TrainerLayout, rank_memory, with_changes
from trainer.node_plan import NodeShare, checkpoint_bytes, node_shares, shm_needed

# The `tide run` driver process on cpu (Ray's client, the tokenizer, the batches): its VmHWM in the quickstart,
# measured 2026-12-06 (scripts/validate_plan.py)
CPU_DRIVER = 528 * 2**20
PROMPT_SAMPLE = 256  # prompts rendered to find the longest


class Lengths(BaseModel):
    prompt_tokens: int
    prompt_source: str  # where prompt_tokens came from
    completion_tokens: int
    micro_batch_rows: int
    micro_batch_positions: int  # per row (packed: the row's budget)


class Change(BaseModel):
    setting: str  # the config override, e.g. "trainer.recompute=full"
    rank_gb: float | None = None
    engine_gb: float | None = None
    fits: bool


class NodeReport(BaseModel):
    node: int
    ranks: list[dict[str, int]]  # each rank's {rank, tp, ep, dp, pp}
    stages: list[int]
    expert_ranks: list[int]
    replicas: list[int]  # trainer.parallel.dp replicas
    published_bytes: int  # written into the node's shared memory per iteration
    published_gb: float
    shm_needed_gb: float  # publish.keep_last + 1 iterations of it
    shm_fits: bool | None  # None: no --shm-gb given


class Plan(BaseModel):
    model: dict[str, int | bool]
    parameters: int
    lengths: Lengths
    device: Literal["cpu", "cuda"]
    capacity_gb: float  # per GPU on cuda, the host's RAM on cpu
    ranks: int
    rank: dict[str, float]  # GiB by item, "total" included
    activations_by_recompute_gb: dict[str, float]
    engines: int
    engine: dict[str, float]
    engine_concurrency: int
    engine_sequences_cached: int
    node_total_gb: float | None  # cpu: every process of the run on the host
    gpus: int | None  # cuda: trainer GPUs + engine GPUs
    trainer_nodes: int
    checkpoint_bytes: int  # the published Hugging Face checkpoint, one iteration
    checkpoint_gb: float
    nodes: list[NodeReport] | None  # placement.trainer_nodes > 1
    fits: bool
    problems: list[str]
    changes: list[Change]
    notes: list[str]


def gb(n: float) -> float:
    return round(n / GiB, 3)


def model_shape(cfg: TideConfig) -> tuple[ModelShape, str]:
    """The trainer's architecture (the family's megatron_transformer_kwargs, as trainer/megatron/model.py builds
    it) and the model directory (a tiny model is built as `tide run` builds it)."""
    from transformers import AutoConfig

    from ckpt_transfer.convert import family
    from orchestrator.config.model_source import resolve_model_dir
    from rollout.tasks import make_task

    if cfg.model.path:
        model_dir = cfg.model.path
    else:
        model_dir = resolve_model_dir(None, cfg.model.tiny, make_task(cfg.task, seed=cfg.seed), cfg.seed)
    hf = AutoConfig.from_pretrained(model_dir)
    kw = family(hf).megatron_transformer_kwargs(hf)
    return ModelShape.from_megatron(kw, hf.vocab_size, bool(getattr(hf, "tie_word_embeddings", False))), model_dir


def prompt_tokens(cfg: TideConfig, model_dir: str, given: int | None) -> tuple[int, str]:
    """The longest prompt: --prompt-tokens, rollout.max_prompt_tokens, else the longest of PROMPT_SAMPLE of the
    task's prompts rendered as the run renders them, else what the context leaves beside max_new_tokens."""
    r = cfg.rollout
    if given:
        return given, "--prompt-tokens"
    if r.max_prompt_tokens:
        return r.max_prompt_tokens, "rollout.max_prompt_tokens"
    try:
        from transformers import AutoTokenizer

        from orchestrator.workers.prompts import PromptRenderer
        from rollout.tasks import make_task

        renderer = PromptRenderer(AutoTokenizer.from_pretrained(model_dir), cfg.model.chat_template,
                                  cfg.model.system_prompt, template_kwargs=cfg.model.chat_template_kwargs)
        problems = make_task(cfg.task, seed=cfg.seed).problems(cfg.seed, 1, PROMPT_SAMPLE)
        longest = max(len(p.prompt_ids) for p in renderer.render_all(problems)[0])
        return longest, f"longest of {PROMPT_SAMPLE} rendered prompts"
    except Exception as e:  # a task that needs a service (code), a dataset not at hand
        import json
        from pathlib import Path

        context = r.max_model_len or json.loads((Path(model_dir) / "config.json").read_text()).get(
            "max_position_embeddings", 4096)
        return max(context - r.max_new_tokens, 1), f"the context's rest ({type(e).__name__} rendering prompts)"


def trainer_layout(cfg: TideConfig, shape: ModelShape, longest: int) -> TrainerLayout:
    """The busiest micro-batch of an RL step: rows of `longest` positions (the mini-batch's share on one
    data-parallel rank, at most micro_batch_size; with micro_batch_tokens as many as its budget holds; packed:
    one row of the budget)."""
    t, r = cfg.trainer, cfg.rollout
    p = t.parallel
    parts = p.tp if p.tp > 1 and shape.experts else 1  # sequence parallelism pads to a tp multiple
    seq_len = -(-(longest - 1) // parts) * parts
    share = -(-r.prompts_per_iteration * r.n_samples // (t.updates_per_iteration * p.dp))
    if t.packing:
        rows, seq_len = 1, max(t.micro_batch_tokens, seq_len)
    elif t.micro_batch_tokens:
        rows = min(max(t.micro_batch_tokens // seq_len, 1), share)
    else:
        rows = min(t.micro_batch_size, share)
    distributed = t.backend == "nccl" if t.distributed_optimizer is None else t.distributed_optimizer
    return TrainerLayout(rows=rows, seq_len=seq_len, dtype=cfg.model.dtype, dp=p.dp, tp=p.tp, pp=p.pp, ep=p.ep,
                         attention=t.attention, recompute=t.recompute, logprob_chunk=t.logprob_chunk,
                         distributed_optimizer=distributed, sequence_parallel=parts > 1,
                         reference=t.kl.coef > 0, device=t.device, lora_rank=t.lora.rank if t.lora else 0,
                         lora_targets=tuple(t.lora.target_modules) if t.lora else ())


def engine_plan(cfg: TideConfig, shape: ModelShape, seq_tokens: int, gpu_bytes: int | None,
                engines: int | None = None, max_num_seqs: int | None = None) -> EngineMemory:
    r = cfg.rollout
    engines = engines or r.engines
    share = -(-r.prompts_per_iteration // engines) * r.n_samples * (r.max_staleness if r.partial_rollout else 1)
    concurrency = min(max_num_seqs or r.max_num_seqs or max(share, 256), share)
    return engine_memory(parameters=shape.parameters(), kv_elements_per_token=shape.kv_elements_per_token(),
                         dtype_bytes=DTYPE_BYTES[cfg.model.dtype], tp=r.tp, concurrency=concurrency,
                         seq_tokens=seq_tokens, kv_cache_bytes=r.kv_cache_bytes, device=r.device,
                         gpu_bytes=gpu_bytes, gpu_memory_utilization=r.gpu_memory_utilization,
                         lora_parameters=engine_lora_parameters(cfg, shape))


def engine_lora_parameters(cfg: TideConfig, shape: ModelShape) -> int:
    """trainer.lora sync adapter: the adapter slots an engine allocates (rollout/lora_serving.py's LLM arguments:
    max_loras on the device, max_cpu_loras more in host memory, which on cpu is the same memory), each at the
    slot's rank on the targeted projections; 0 without."""
    from orchestrator.config.schema import engine_lora
    from rollout.lora_serving import lora_llm_kwargs
    from trainer.memory_plan import lora_parameters

    kwargs = lora_llm_kwargs(engine_lora(cfg.trainer.lora))
    if not kwargs:
        return 0
    slots = kwargs["max_loras"] + (kwargs["max_cpu_loras"] if cfg.rollout.device == "cpu" else 0)
    whole = TrainerLayout(rows=1, seq_len=1, lora_rank=kwargs["max_lora_rank"],
                          lora_targets=tuple(kwargs["lora_target_modules"]))
    return slots * lora_parameters(shape, whole)


def _host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan(cfg: TideConfig, gpus_per_node: int = 8, gpu_memory_gb: float = 80.0, host_memory_gb: float | None = None,
         given_prompt_tokens: int | None = None, shm_gb: float | None = None) -> Plan:
    shape, model_dir = model_shape(cfg)
    t, r = cfg.trainer, cfg.rollout
    prompt, source = prompt_tokens(cfg, model_dir, given_prompt_tokens)
    completion = cfg.agent.max_total_tokens if cfg.agent else r.max_new_tokens
    layout = trainer_layout(cfg, shape, prompt + completion)
    cuda = t.device == "cuda"
    capacity = int(gpu_memory_gb * GiB) if cuda else int((host_memory_gb * GiB) if host_memory_gb else _host_bytes())
    gpu = int(gpu_memory_gb * GiB) if r.device == "cuda" else None
    engine = engine_plan(cfg, shape, prompt + completion, gpu)
    ranks = t.parallel.world

    def node_total(rank: RankMemory, eng: EngineMemory) -> int:  # cpu: the host's share of every process
        return ranks * rank.total + (r.engines * eng.total if r.device == "cpu" else 0) + CPU_DRIVER

    def rank_fits(rank: RankMemory, eng: EngineMemory) -> bool:
        return rank.total <= capacity if cuda else node_total(rank, eng) <= capacity

    rank = rank_memory(shape, layout)
    problems = []
    if not rank_fits(rank, engine):
        problems.append(f"a trainer rank needs {gb(rank.total)} GiB of {gb(capacity)} GiB" if cuda else
                        f"the run needs {gb(node_total(rank, engine))} GiB of the host's {gb(capacity)} GiB")
    if gpu is not None and engine.total > gpu:
        problems.append(f"an engine needs {gb(engine.total)} GiB per GPU of {gb(gpu)} GiB")
    if engine.kv_needed > engine.kv_cache:
        problems.append(f"an engine's {engine.concurrency} concurrent sequences of {prompt + completion} tokens need "
                        f"{gb(engine.kv_needed)} GiB of KV cache, it has {gb(engine.kv_cache)} GiB: vLLM preempts "
                        f"and recomputes ({engine.sequences_cached} fit at once)")
    gpus = ranks + r.engines * r.tp if cuda or r.device == "cuda" else None
    trainer_nodes = cfg.placement.trainer_nodes
    if cuda and ranks > gpus_per_node * trainer_nodes:
        problems.append(f"{ranks // trainer_nodes} trainer ranks on each of placement.trainer_nodes {trainer_nodes} "
                        f"node(s) with {gpus_per_node} GPUs")
    nodes, published = None, checkpoint_bytes(shape, cfg.model.dtype)
    if trainer_nodes > 1:
        try:
            shares = node_shares(shape, layout, trainer_nodes, cfg.model.dtype)
        except ValueError as e:  # a tensor-parallel group across nodes
            problems.append(str(e))
            shares = []
        nodes = [_node_report(share, cfg.publish.keep_last, shm_gb) for share in shares]
        problems += [f"node {n.node} needs {n.shm_needed_gb} GiB of shared memory for its share of the checkpoint "
                     f"(publish.keep_last + 1 iterations of {n.published_gb} GiB), it has {shm_gb} GiB"
                     for n in nodes if n.shm_fits is False]
    changes = _changes(cfg, shape, layout, engine, prompt + completion, gpu, gpus_per_node * trainer_nodes, rank_fits,
                       rank_short=not rank_fits(rank, engine)) if problems else []
    notes = [f"prompt tokens: {source}"]
    if not cuda and rank.baseline > 0.5 * rank.total:
        notes.append(f"the process baseline ({gb(rank.baseline)} GiB: Python, torch, Megatron, Ray) is most of a "
                     f"rank's memory; the model's own share is {gb(rank.total - rank.baseline)} GiB")
    return Plan(model={k: v for k, v in asdict(shape).items()}, parameters=shape.parameters(),
                lengths=Lengths(prompt_tokens=prompt, prompt_source=source, completion_tokens=completion,
                                micro_batch_rows=layout.rows, micro_batch_positions=layout.seq_len),
                device=t.device, capacity_gb=gb(capacity), ranks=ranks, rank=_rank_items(rank),
                activations_by_recompute_gb={k: gb(v) for k, v in rank.activations_by_recompute.items()},
                engines=r.engines, engine=_engine_items(engine), engine_concurrency=engine.concurrency,
                engine_sequences_cached=engine.sequences_cached,
                node_total_gb=None if cuda else gb(node_total(rank, engine)), gpus=gpus,
                trainer_nodes=trainer_nodes, checkpoint_bytes=published, checkpoint_gb=gb(published), nodes=nodes,
                fits=not problems, problems=problems, changes=changes, notes=notes)


def _node_report(share: NodeShare, keep_last: int, shm_gb: float | None) -> NodeReport:
    needed = shm_needed(share.published, keep_last)
    return NodeReport(node=share.node, ranks=[asdict(c) for c in share.ranks], stages=share.coordinates("pp"),
                      expert_ranks=share.coordinates("ep"), replicas=share.coordinates("dp"),
                      published_bytes=share.published, published_gb=gb(share.published), shm_needed_gb=gb(needed),
                      shm_fits=None if shm_gb is None else needed <= shm_gb * GiB)


def _rank_items(m: RankMemory) -> dict[str, float]:
    items = {"baseline": m.baseline, "weights": m.weights, "gradients": m.gradients, "optimizer": m.optimizer,
             "activations": m.activations, "logits": m.logits, "logprob_chunk": m.logprob_chunk,
             "allocator": m.allocator, "total": m.total}
    return {k: gb(v) for k, v in items.items()}


def _engine_items(e: EngineMemory) -> dict[str, float]:
    return {k: gb(v) for k, v in {"baseline": e.baseline, "weights": e.weights, "lora": e.lora,
                                  "kv_cache": e.kv_cache, "kv_needed": e.kv_needed, "total": e.total}.items()}


def _changes(cfg: TideConfig, shape: ModelShape, layout: TrainerLayout, engine: EngineMemory, seq_tokens: int,
             gpu: int | None, trainer_gpus: int, rank_fits, rank_short: bool) -> list[Change]:
    """Where a rank does not fit: single changes, cheapest first (those that cost compute before those that cost
    GPUs), each one's figures and whether it alone makes the rank fit, then, where none does, the first ones
    together up to the one that does. Where the engines' KV cache is short: the engines or the concurrency that
    hold it."""
    t, r = cfg.trainer, cfg.rollout
    out: list[Change] = []
    tries: list[tuple[str, dict]] = []
    if layout.attention == "eager":
        tries.append(("trainer.attention=sdpa", {"attention": "sdpa"}))
    if layout.recompute == "none":
        tries.append(("trainer.recompute=selective", {"recompute": "selective"}))
    if layout.recompute != "full":
        tries.append(("trainer.recompute=full", {"recompute": "full"}))
    if (layout.logprob_chunk or layout.tokens) > 1024:
        tries.append(("trainer.logprob_chunk=1024", {"logprob_chunk": 1024}))
    if layout.dp > 1 and not layout.distributed_optimizer:
        tries.append(("trainer.distributed_optimizer=true", {"distributed_optimizer": True}))
    tp = layout.tp * 2
    if (shape.heads % tp == 0 and shape.kv_heads % tp in (0, tp) and shape.vocab % tp == 0
            and (layout.device == "cpu" or layout.dp * tp * layout.pp * layout.ep <= trainer_gpus)):
        tries.append((f"trainer.parallel.tp={tp}", {"tp": tp}))
    if layout.rows > 1:  # the most rows that fit (halving), or one
        rows = layout.rows // 2
        while rows > 1 and not rank_fits(rank_memory(shape, with_changes(layout, rows=rows)), engine):
            rows //= 2
        knob = "trainer.micro_batch_tokens=" if t.micro_batch_tokens else "trainer.micro_batch_size="
        tries.append((knob + str(rows * layout.seq_len if t.micro_batch_tokens else rows), {"rows": rows}))
    if rank_short:
        for setting, change in tries:
            m = rank_memory(shape, with_changes(layout, **change))
            out.append(Change(setting=setting, rank_gb=gb(m.total), fits=rank_fits(m, engine)))
        if not any(c.fits for c in out):
            combined, settings = layout, []
            for setting, change in tries:
                combined, settings = with_changes(combined, **change), settings + [setting]
                m = rank_memory(shape, combined)
                if rank_fits(m, engine):
                    break
            out.append(Change(setting=" ".join(settings), rank_gb=gb(m.total), fits=rank_fits(m, engine)))
    if engine.kv_needed > engine.kv_cache:
        for engines in range(r.engines + 1, 8 * r.engines + 1):
            more = engine_plan(cfg, shape, seq_tokens, gpu, engines=engines)
            if more.kv_needed <= more.kv_cache:
                out.append(Change(setting=f"rollout.engines={engines}", engine_gb=gb(more.total), fits=True))
                break
        if engine.sequences_cached:
            out.append(Change(setting=f"rollout.max_num_seqs={engine.sequences_cached}", engine_gb=gb(engine.total),
                              fits=True))
    return out

def render(p: Plan) -> None:
    """The plan as rich tables: the trainer rank's and the engine's memory by item, then the verdict and the
    changes."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    where = f"of {p.capacity_gb} GiB per GPU" if p.device == "cuda" else f"host RAM {p.capacity_gb} GiB"
    lengths = p.lengths
    console.print(f"model: {p.parameters:,} parameters, {p.model['layers']} layers, hidden {p.model['hidden']}, "
                  f"vocabulary {p.model['vocab']}; longest sample {lengths.prompt_tokens} + "
                  f"{lengths.completion_tokens} tokens; micro-batch {lengths.micro_batch_rows} x "
                  f"{lengths.micro_batch_positions} positions")
    table = Table(title=f"memory per process, GiB ({where})")
    table.add_column("item")
    table.add_column(f"trainer rank (x{p.ranks})", justify="right")
    table.add_column(f"engine (x{p.engines})", justify="right")
    rows = ["baseline", "weights", "gradients", "optimizer", "activations", "logits", "logprob_chunk", "allocator",
            *(["lora"] if p.engine.get("lora") else []), "kv_cache", "total"]
    for item in rows:
        table.add_row(item, _cell(p.rank.get(item)), _cell(p.engine.get(item)))
    console.print(table)
    acts = ", ".join(f"{k} {v}" for k, v in p.activations_by_recompute_gb.items())
    console.print(f"activations by trainer.recompute: {acts} GiB")
    console.print(f"engine KV cache: {p.engine['kv_needed']} GiB needed for {p.engine_concurrency} concurrent "
                  f"sequences, {p.engine_sequences_cached} fit in the allocated {p.engine['kv_cache']} GiB")
    if p.node_total_gb is not None:
        console.print(f"the run on this host: {p.node_total_gb} GiB (ranks, engines and the driver)")
    if p.gpus is not None:
        console.print(f"GPUs: {p.gpus} (trainer {p.ranks}, engines {p.gpus - p.ranks})")
    if p.nodes:
        console.print(_node_table(p))
    for note in p.notes:
        console.print(f"[dim]{note}[/dim]")
    if p.fits:
        console.print("[green]fits[/green]")
        return
    for problem in p.problems:
        console.print(f"[red]does not fit:[/red] {problem}")
    changes = Table(title="changes (each alone; the last row, where none fits alone: together)")
    for col in ("setting", "rank GiB", "engine GiB", "fits"):
        changes.add_column(col)
    for c in p.changes:
        changes.add_row(c.setting, _cell(c.rank_gb), _cell(c.engine_gb), "yes" if c.fits else "no")
    console.print(changes)


def _node_table(p: Plan):
    """Per trainer node: its ranks and their coordinates, its share of the published checkpoint and the shared
    memory that share needs."""
    from rich.table import Table

    table = Table(title=f"trainer nodes (x{p.trainer_nodes}): ranks by pipeline stage, data-parallel replica and "
                  f"expert rank; each node's share of the published checkpoint ({p.checkpoint_gb} GiB) and the "
                  f"shared memory it needs (publish.keep_last + 1 iterations)")
    for col in ("node", "ranks", "pp", "dp", "ep", "published GiB", "shm GiB", "fits shm"):
        table.add_column(col, justify="right")
    for n in p.nodes or []:
        ranks = f"{n.ranks[0]['rank']}-{n.ranks[-1]['rank']}" if n.ranks else ""
        table.add_row(str(n.node), ranks, _span(n.stages), _span(n.replicas), _span(n.expert_ranks),
                      f"{n.published_gb:.3f}", f"{n.shm_needed_gb:.3f}",
                      "" if n.shm_fits is None else "yes" if n.shm_fits else "no")
    return table


def _span(values: list[int]) -> str:
    return f"{values[0]}-{values[-1]}" if len(values) > 1 and values == list(range(values[0], values[-1] + 1)) \
        else ",".join(map(str, values))


def _cell(v: float | None) -> str:
    return "" if v is None else f"{v:.3f}"
