"""What one trainer rank holds at its peak, from the model's shape and the trainer's settings: weights, gradients,
optimizer state, activations (at the micro-batch of the longest sample, for each trainer.recompute), the logits and
the log-prob chunk's float32 temporaries. Pure arithmetic on dataclasses: no torch, no Megatron (`tide plan` and
scripts/bench_long.py call it without building a model). The formulas are written out in docs/training.md
("Memory planner"); the engines' side is rollout/memory_plan.py."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Mapping

Recompute = Literal["none", "selective", "full"]
RECOMPUTES: tuple[Recompute, ...] = ("none", "selective", "full")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GiB = 2**30

# A trainer rank's process before it holds any of the model (Python, torch, Megatron, Ray's worker, gloo): the
# VmHWM of a Ray actor that imported the rank's modules and built a MegatronWorker of the quickstart's tiny model
# (under 0.2 MB of parameters), measured on 2026-12-06 with `scripts/validate_plan.py --calibrate` (578 MB).
CPU_RANK_BASELINE = 578 * 2**20
# On cuda: the CUDA context and the caching allocator's reserve beside the tensors (about 0.5-1 GB; the upper end)
CUDA_RANK_BASELINE = 1 * GiB
# On cpu the resident set exceeds the tensors alive at the peak: glibc's malloc keeps freed heap memory (each
# thread's arena, below the mmap threshold) resident, and a step's many same-sized activations land beside it.
# Measured VmHWM over these tensors (baseline aside), 2026-12-06: 1.21-1.47 in a fresh process after two steps of a
# 34M model at 1024-2048 positions (scripts/validate_plan.py --step), 0.99-1.12 over the repeated steps of
# scripts/bench_long.py --quick (VmHWM reset before each, ~5M model, 1k-4k positions). 0.2 keeps both within 20%.
CPU_ALLOCATOR_OVERHEAD = 0.2
# The log-prob pass's float32 tensors per chunk position and vocabulary entry: the tempered logits, their
# log-softmax (kept for the backward) and its gradient (trainer/megatron/logprobs.py)
LOGPROB_TEMPORARIES = 3


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder the trainer builds: Megatron's TransformerConfig fields
    (ckpt_transfer/convert's megatron_transformer_kwargs) plus the vocabulary. MoE fields are 0 for dense models;
    mla_* for multi-latent attention (deepseek_v3)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    linear_bias: bool = False
    qk_norm: bool = False
    attention_sinks: bool = False  # gpt_oss: a learnable softmax offset per head
    experts: int = 0
    moe_layers: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    top_k: int = 0
    mla_q_rank: int = 0  # 0: no q latent (q projected from the hidden state)
    mla_kv_rank: int = 0
    mla_rope_dim: int = 0
    mla_v_dim: int = 0

    @classmethod
    def from_megatron(cls, kw: Mapping[str, Any], vocab: int, tied_embeddings: bool) -> "ModelShape":
        """From a family's megatron_transformer_kwargs (the architecture the trainer builds) and config.json's
        vocab_size and tie_word_embeddings."""
        experts = int(kw.get("num_moe_experts") or 0)
        pattern = kw.get("moe_layer_freq", 1)
        moe_layers = 0 if not experts else (sum(pattern) if isinstance(pattern, list) else
                                            sum(1 for i in range(kw["num_layers"]) if i % pattern == 0))
        mla = bool(kw.get("multi_latent_attention"))
        return cls(
            layers=kw["num_layers"], hidden=kw["hidden_size"], ffn=kw["ffn_hidden_size"],
            heads=kw["num_attention_heads"], kv_heads=kw.get("num_query_groups") or kw["num_attention_heads"],
            head_dim=(kw["qk_head_dim"] + kw["qk_pos_emb_head_dim"]) if mla else kw["kv_channels"],
            vocab=vocab, tied_embeddings=tied_embeddings, qkv_bias=bool(kw.get("add_qkv_bias")),
            linear_bias=bool(kw.get("add_bias_linear")), qk_norm=bool(kw.get("qk_layernorm")) and not mla,
            attention_sinks=kw.get("softmax_type") == "learnable",
            experts=experts, moe_layers=moe_layers, moe_ffn=int(kw.get("moe_ffn_hidden_size") or 0),
            shared_ffn=int(kw.get("moe_shared_expert_intermediate_size") or 0),
            top_k=int(kw.get("moe_router_topk") or 0),
            mla_q_rank=int(kw.get("q_lora_rank") or 0) if mla else 0,
            mla_kv_rank=int(kw.get("kv_lora_rank") or 0) if mla else 0,
            mla_rope_dim=int(kw.get("qk_pos_emb_head_dim") or 0) if mla else 0,
            mla_v_dim=int(kw.get("v_head_dim") or 0) if mla else 0)

    @property
    def mla(self) -> bool:
        return self.mla_kv_rank > 0

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Keys plus values per token, as the core attention gets them."""
        if self.mla:
            return self.heads * (self.head_dim + self.mla_v_dim)
        return 2 * self.kv_heads * self.head_dim

    @property
    def out_width(self) -> int:
        return self.heads * (self.mla_v_dim if self.mla else self.head_dim)

    def attention_parameters(self) -> int:
        h = self.hidden
        if self.mla:
            q = (h * self.mla_q_rank + self.mla_q_rank + self.mla_q_rank * self.q_width if self.mla_q_rank
                 else h * self.q_width)
            kv = (h * (self.mla_kv_rank + self.mla_rope_dim) + self.mla_kv_rank
                  + self.mla_kv_rank * self.heads * (self.head_dim - self.mla_rope_dim + self.mla_v_dim))
            return q + kv + self.out_width * h + h
        qkv = h * (self.q_width + self.kv_width) + (self.q_width + self.kv_width if self.qkv_bias else 0)
        norms = 2 * self.head_dim if self.qk_norm else 0
        sinks = self.heads if self.attention_sinks else 0
        return qkv + norms + sinks + self.out_width * h + (h if self.linear_bias else 0) + h  # + the input norm

    def mlp_parameters(self, ffn: int) -> int:
        """A gated MLP (SwiGLU: fc1 holds gate and up) of width `ffn`."""
        bias = 2 * ffn + self.hidden if self.linear_bias else 0
        return 3 * self.hidden * ffn + bias

    def expert_parameters(self) -> int:
        """Every routed expert of every MoE layer (sharded over expert-parallel ranks)."""
        return self.moe_layers * self.experts * self.mlp_parameters(self.moe_ffn)

    def parameters(self) -> int:
        h, dense_layers = self.hidden, self.layers - self.moe_layers
        router = (h + 1 if self.linear_bias else h) * self.experts
        moe_rest = self.moe_layers * (router + (self.mlp_parameters(self.shared_ffn)
                                                          if self.shared_ffn else 0))
        embeddings = self.vocab * h * (1 if self.tied_embeddings else 2)
        return (self.layers * (self.attention_parameters() + h) + dense_layers * self.mlp_parameters(self.ffn)
                + moe_rest + self.expert_parameters() + embeddings + h)

    def kv_elements_per_token(self) -> int:
        """What a KV cache holds per token: keys and values of every layer (MLA: the compressed latent and the
        rope key, as vLLM caches them)."""
        if self.mla:
            return self.layers * (self.mla_kv_rank + self.mla_rope_dim)
        return self.layers * 2 * self.kv_heads * self.head_dim


@dataclass(frozen=True)
class TrainerLayout:
    """The trainer settings the memory depends on (trainer/config.py's fields) and the micro-batch: `rows`
    sequences of `seq_len` positions each (packed: one row of several sequences, each at most `seq_len`)."""

    rows: int
    seq_len: int
    dtype: str = "float32"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    attention: Literal["sdpa", "eager"] = "sdpa"
    recompute: Recompute = "none"
    logprob_chunk: int | None = 4096
    distributed_optimizer: bool = False
    sequence_parallel: bool = False
    reference: bool = False  # trainer.kl: a frozen copy of the weights
    device: Literal["cpu", "cuda"] = "cpu"
    lora_rank: int = 0  # trainer.lora: adapters of this rank on `lora_targets` (PEFT's names); 0: no LoRA
    lora_targets: tuple[str, ...] = ()

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_len


@dataclass(frozen=True)
class RankMemory:
    """Bytes one trainer rank holds at its peak, by what holds them; `activations_by_recompute`: the
    activations under each trainer.recompute, `activations` the configured one's."""

    baseline: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    logprob_chunk: int
    allocator: int = 0  # cpu: CPU_ALLOCATOR_OVERHEAD of the tensors
    activations_by_recompute: dict[str, int] = field(default_factory=dict)

    @property
    def tensors(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.logprob_chunk

    @property
    def total(self) -> int:
        return self.baseline + self.tensors + self.allocator


def rank_parameters(shape: ModelShape, layout: TrainerLayout) -> int:
    """Parameters on the busiest rank: dense ones split over tp and pp (the embedding and output layer over tp,
    on the first and last stage: counted whole when pp 1, the larger stage's otherwise), experts over ep and tp."""
    experts = shape.expert_parameters()
    dense = shape.parameters() - experts
    embedding = shape.vocab * shape.hidden
    per_stage_layers = dense - embedding * (1 if shape.tied_embeddings else 2)
    stage = per_stage_layers / layout.pp + embedding * (1 if shape.tied_embeddings or layout.pp > 1 else 2)
    return math.ceil(stage / layout.tp + experts / (layout.pp * layout.ep * layout.tp))


# LoRA targets by PEFT's name. Attention projections, in every layer: (input width, output width, column-parallel)
# from a shape. Column-parallel linears split their output over tp (their B is split, A whole), row-parallel ones
# their input (A split, B whole). MLP projections: (column-parallel, also in dense MLPs and shared experts), every
# routed expert having its own; Mixtral names its experts' w1 (gate), w3 (up), w2 (down) and has no dense MLP.
LORA_PROJECTIONS = {
    "q_proj": lambda s: (s.hidden, s.q_width, True),
    "k_proj": lambda s: (s.hidden, s.kv_heads * s.head_dim, True),
    "v_proj": lambda s: (s.hidden, s.kv_heads * s.head_dim, True),
    "o_proj": lambda s: (s.out_width, s.hidden, False),
    "q_a_proj": lambda s: (s.hidden, s.mla_q_rank, True),
    "q_b_proj": lambda s: (s.mla_q_rank, s.q_width, True),
    "kv_a_proj_with_mqa": lambda s: (s.hidden, s.mla_kv_rank + s.mla_rope_dim, True),
    "kv_b_proj": lambda s: (s.mla_kv_rank, s.heads * (s.head_dim - s.mla_rope_dim + s.mla_v_dim), True),
}
LORA_MLP = {"gate_proj": (True, True), "up_proj": (True, True), "down_proj": (False, True),
            "w1": (True, False), "w3": (True, False), "w2": (False, False)}  # (column-parallel, dense MLPs too)


def lora_parameters(shape: ModelShape, layout: TrainerLayout) -> int:
    """The adapters' parameters on the busiest rank (trainer.lora: r x (input + output) per adapted projection,
    each factor split as its linear is), dense ones over tp and pp, experts' over ep, tp and pp. A target the
    planner does not know is a ValueError naming it."""
    r, tp = layout.lora_rank, layout.tp

    def adapter(inp: int, out: int, column: bool) -> float:
        return r * (inp + out / tp) if column else r * (inp / tp + out)

    unknown = sorted(set(layout.lora_targets) - set(LORA_PROJECTIONS) - set(LORA_MLP))
    if unknown:
        raise ValueError(f"trainer.lora.target_modules {unknown}: the memory planner counts adapters on "
                         f"{', '.join([*LORA_PROJECTIONS, *LORA_MLP])}")
    dense = experts = 0.0
    for name in layout.lora_targets:
        if name in LORA_PROJECTIONS:
            dense += shape.layers * adapter(*LORA_PROJECTIONS[name](shape))
            continue
        column, in_dense_mlps = LORA_MLP[name]
        for ffn, count, routed in ((shape.ffn, shape.layers - shape.moe_layers, False),
                                   (shape.shared_ffn, shape.moe_layers, False),
                                   (shape.moe_ffn, shape.moe_layers * shape.experts, True)):
            if not ffn or not count or (not routed and not in_dense_mlps):
                continue
            size = count * adapter(*((shape.hidden, ffn) if column else (ffn, shape.hidden)), column)
            if routed:
                experts += size
            else:
                dense += size
    return math.ceil(dense / layout.pp + experts / (layout.pp * layout.ep))


def saved_per_token(shape: ModelShape, layout: TrainerLayout, moe: bool) -> float:
    """Elements one transformer layer keeps per token for its backward pass, outside the core attention's own
    (see layer_activation_elements).

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 1-2) count
    s*b*h*(34 + 5*a*s/h) bytes per layer in 16 bits for a GPT layer with dropout and a 4h GeLU MLP, (10 + 24/t)
    under tensor parallelism without sequence parallelism. tide's layers differ: no dropout (no masks), RMSNorm,
    rotary q and k, grouped-query or latent attention, a gated MLP. Counted with torch's saved-tensor hooks on
    Megatron's local layers (megatron-core 0.19, torch 2.13; scripts/validate_plan.py --step), per token:
      replicated over tp (split only with sequence parallelism): 5h (the two norms' inputs and outputs, the
        residual);
      split over tp: q + k + v (the fused qkv projection's output, alive through v's view), q + k again (rotated),
        the projection's input (a copy of the core attention's output), and 5f for a gated MLP
        (fc1's 2f, the activation's and the product's f each, and one more f copy); an MoE layer: top_k x (h + 5
        f_expert) plus the shared expert's h + 5f; qk-norm keeps q + k once more, latent attention its latents."""
    h, t = shape.hidden, layout.tp
    replicated = 5 * h / (t if layout.sequence_parallel else 1)
    q, kv, o = shape.q_width, shape.kv_width, shape.out_width
    k = kv // 2 if not shape.mla else shape.heads * shape.head_dim
    attention = q + kv + q + k + o
    if shape.qk_norm:
        attention += q + k
    if shape.mla:
        attention += 2 * shape.mla_q_rank + 2 * shape.mla_kv_rank
    if moe:
        mlp = shape.top_k * (h + 5 * shape.moe_ffn) + (h + 5 * shape.shared_ffn if shape.shared_ffn else 0)
    else:
        mlp = 5 * shape.ffn
    return replicated + (attention + mlp) / t


def core_attention_elements(shape: ModelShape, layout: TrainerLayout) -> float:
    """What the core attention itself keeps per layer and micro-batch: its output and, eager (Megatron's local
    attention), its [rows, heads/t, s, s] softmax probabilities (the paper's 5as/h term without dropout: the
    scores are overwritten in place), sdpa a float32 log-sum-exp per head and token (linear in s)."""
    heads = shape.heads / layout.tp
    if layout.attention == "eager":
        return (shape.out_width / layout.tp + heads * layout.seq_len) * layout.tokens
    return (shape.out_width / layout.tp + heads * 4 / DTYPE_BYTES[layout.dtype]) * layout.tokens


def activation_bytes(shape: ModelShape, layout: TrainerLayout, recompute: Recompute | None = None) -> int:
    """The activations a pipeline stage holds at its peak for one micro-batch's backward, under `recompute`
    (default: the layout's), in the layout's dtype: every layer's saved tensors (saved_per_token x tokens +
    core_attention_elements), plus what one layer's backward adds: eager, the scores' and probabilities'
    gradients ([rows, heads/t, s, s] twice), and the mask ([s, s] bytes per layer). `selective` keeps no core
    attention output (recomputed per layer in its backward: one layer's at a time); `full` keeps each layer's
    input only (Korthikanti's 2sbh per layer in 16 bits) plus one layer's whole activations, recomputed during
    its backward."""
    recompute = recompute or layout.recompute
    layers = math.ceil(shape.layers / layout.pp)
    moe_share = shape.moe_layers / shape.layers if shape.layers else 0.0
    rest = ((1 - moe_share) * saved_per_token(shape, layout, False)
            + moe_share * saved_per_token(shape, layout, True)) * layout.tokens
    largest = max(saved_per_token(shape, layout, shape.moe_layers > 0),
                  saved_per_token(shape, layout, False)) * layout.tokens
    core = core_attention_elements(shape, layout)
    eager = layout.attention == "eager"
    transient = 2 * shape.heads / layout.tp * layout.seq_len * layout.tokens if eager else 0.0
    if recompute == "none":
        elements = layers * (rest + core)
    elif recompute == "selective":
        elements = layers * rest + core
    else:
        elements = layers * shape.hidden * layout.tokens / (layout.tp if layout.sequence_parallel else 1)
        elements += largest + core
    # a pipeline's first stage holds the activations of pp micro-batches in flight (1F1B's warm-up; Korthikanti
    # et al. 2022, section 4.2.3)
    elements *= layout.pp
    mask = layers * layout.seq_len ** 2 if eager else 0  # bytes: one boolean [s, s] per layer
    return math.ceil((elements + transient) * DTYPE_BYTES[layout.dtype] + mask)


def logits_bytes(shape: ModelShape, layout: TrainerLayout) -> tuple[int, int]:
    """(the output layer's logits [positions, V/tp] in the model's dtype and their gradient, the float32 log-prob
    temporaries), for one trainer.logprob_chunk of positions (trainer/megatron/logprobs.py turns the final hidden
    states into logits a chunk at a time, in the forward and the backward pass) or, when null, the whole
    micro-batch."""
    vocab = shape.vocab / layout.tp
    positions = min(layout.logprob_chunk or layout.tokens, layout.tokens)
    return (math.ceil(2 * positions * vocab * DTYPE_BYTES[layout.dtype]),
            math.ceil(positions * vocab * 4 * LOGPROB_TEMPORARIES))


def rank_memory(shape: ModelShape, layout: TrainerLayout) -> RankMemory:
    """The peak of one trainer rank (on cpu its resident set: the tensors plus CPU_ALLOCATOR_OVERHEAD of them).
    Megatron's DDP keeps float32 gradients (grad_reduce_in_fp32); Adam keeps two
    float32 moments, and under 16-bit parameters float32 main parameters too (Rajbhandari et al. 2020, ZeRO:
    12 bytes per parameter), sharded over the data-parallel ranks by the distributed optimizer."""
    params = rank_parameters(shape, layout)
    width = DTYPE_BYTES[layout.dtype]
    # trainer.lora: the base is frozen (no gradient buffer, no optimizer state, and the reference policy of
    # trainer.kl is the base with the adapters off: no copy); the adapters alone train
    adapters = lora_parameters(shape, layout) if layout.lora_rank else 0
    trained = adapters if layout.lora_rank else params
    optimizer = trained * (8 if width == 4 else 12)
    if layout.distributed_optimizer:
        optimizer = math.ceil(optimizer / layout.dp)
    logits, chunk = logits_bytes(shape, layout)
    by_recompute = {r: activation_bytes(shape, layout, r) for r in RECOMPUTES}
    copies = 2 if layout.reference and not layout.lora_rank else 1
    m = RankMemory(
        baseline=CPU_RANK_BASELINE if layout.device == "cpu" else CUDA_RANK_BASELINE,
        weights=(params * copies + adapters) * width, gradients=trained * 4, optimizer=optimizer,
        activations=by_recompute[layout.recompute], logits=logits, logprob_chunk=chunk,
        activations_by_recompute=by_recompute)
    return replace(m, allocator=math.ceil(m.tensors * CPU_ALLOCATOR_OVERHEAD)) if layout.device == "cpu" else m


def single_step_memory(shape: ModelShape, length: int, *, rows: int = 1, dtype: str = "float32",
                       attention: Literal["sdpa", "eager"] = "sdpa", recompute: Recompute = "none",
                       logprob_chunk: int | None = 4096, device: Literal["cpu", "cuda"] = "cpu") -> RankMemory:
    """One rank's peak for one train step of `rows` sequences of `length` positions on one rank (no
    parallelism): what scripts/bench_long.py measures; compare `.total` with its rank's VmHWM."""
    return rank_memory(shape, TrainerLayout(rows=rows, seq_len=length, dtype=dtype, attention=attention,
                                            recompute=recompute, logprob_chunk=logprob_chunk, device=device))


def with_changes(layout: TrainerLayout, **changes: Any) -> TrainerLayout:
    return replace(layout, **changes)
