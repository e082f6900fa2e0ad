"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685) on Megatron-core's
tensor-parallel linears, parameterised exactly as PEFT's `LoraConfig` (one A and one B per targeted Hugging Face
projection; W x + (alpha / r) B A x; A initialised as PEFT does, B zero), so that an adapter trained here is a PEFT
adapter and one trained with PEFT could continue here.

Megatron fuses projections that Hugging Face keeps apart (q, k and v in linear_qkv, gate and up in linear_fc1).
Which local output rows of a fused linear hold which projection is read off the family's own converter
(`megatron_to_hf` applied to a tensor of row indices), so no family-specific layout is written twice: the
adapter of a fused linear keeps each projection's A and B apart and scatters B's rows into the fused layout.

Tensor parallelism, with the collectives Megatron's own linears use (megatron.core.tensor_parallel.mappings):
- column-parallel base (the output split): A is replicated; B holds this rank's rows. h = x A^T is all-reduced in
  the backward pass (copy_to_tensor_model_parallel_region), so A's gradient is whole on every rank; under
  sequence parallelism x is first gathered over the sequence (its gradient split back, being whole).
- row-parallel base (the input split): A holds this rank's input columns; B is replicated. The partial h = x A^T
  is all-reduced (or reduce-scattered over the sequence, as the base's output is) before B; under sequence
  parallelism B's gradient is a partial sum over the sequence slices, which Megatron's finalize_model_grads sums
  over the tensor-parallel ranks (the `sequence_parallel` mark, as for norms).
Adapters are initialised from their Hugging Face name and the run's seed, whole, then sliced: every layout starts
from the same adapter. The adapter sits beside its linear (`<linear>_lora`), with a sharded state dict of its own,
so Megatron's checkpoints shard it by its own split.
"""
from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from ckpt_transfer.convert.common import ConversionError, HFTensor, RankLayout
from trainer.memory_plan import LORA_MLP

if TYPE_CHECKING:
    from trainer.config import LoRAConfig

SUFFIX = "_lora"  # an adapter's module name: its linear's, with this suffix, in the same parent


class LoRAError(ValueError):
    """trainer.lora cannot be applied to this model or layout as configured."""


@dataclass(frozen=True)
class Part:
    """One targeted Hugging Face projection inside a Megatron linear."""

    hf_module: str  # e.g. model.layers.3.self_attn.q_proj
    in_features: int  # whole (before any tensor-parallel split)
    out_features: int  # whole
    rows: torch.Tensor | None  # column-parallel: the local output rows holding it, in HF row order
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def target(self) -> str:
        return self.hf_module.rsplit(".", 1)[1]


def _probe(convert, weight_name: str, weight: torch.Tensor, column: bool, hf_config: Any,
           layout: RankLayout) -> list[tuple[HFTensor, torch.Tensor | None]]:
    """The HF tensors a Megatron weight converts to, each with the local rows it takes (column-parallel)."""
    out, inp = weight.shape
    index = torch.arange(out if column else inp, dtype=torch.float64)
    probe = index[:, None].expand(out, inp) if column else index[None, :].expand(out, inp)
    found = []
    for t in convert([(weight_name, probe.contiguous())], hf_config, layout):
        v = t.value()
        if not column:
            found.append((t, None))
            continue
        if v.dim() != 2 or v.shape[1] != inp or not torch.equal(v, v[:, :1].expand_as(v)):
            raise LoRAError(f"LoRA on {t.name}: its Megatron layout is not whole rows of {weight_name}; "
                            "adapters on it are not implemented")
        found.append((t, v[:, 0].long()))
    return found


def plan_parts(module: nn.Module, hf_config: Any, layout: RankLayout, targets: list[str]) -> dict[str, list[Part]]:
    """Megatron linear name -> the targeted projections in it, for this rank's decoder layers."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from ckpt_transfer.convert import family

    convert = family(hf_config).megatron_to_hf
    probe_layout = replace(layout, dp_rank=0, expert_dp_rank=0)  # every replica plans the same adapters
    plan: dict[str, list[Part]] = {}
    for name, linear in module.named_modules():
        if not name.startswith("decoder.layers.") or not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
            continue
        column = isinstance(linear, ColumnParallelLinear)
        try:
            probed = _probe(convert, f"{name}.weight", linear.weight.detach(), column, hf_config, probe_layout)
        except ConversionError:
            if not getattr(linear, "is_expert", False):
                raise
            check_stacked_experts_untargeted(hf_config, targets)
            continue  # an expert of a checkpoint that stacks them (gpt_oss): no projection of its own to adapt
        parts = []
        for t, rows in probed:
            hf_module = t.name.removesuffix(".weight")
            if hf_module.rsplit(".", 1)[1] not in targets:
                continue
            whole = list(t.hf_shape)
            if t.tp_dim is not None:
                whole[t.tp_dim] *= t.tp_size
            parts.append(Part(hf_module, in_features=whole[1], out_features=whole[0], rows=rows,
                              tp_rank=t.tp_rank if t.tp_dim is not None else 0,
                              tp_size=t.tp_size if t.tp_dim is not None else 1))
        if parts:
            plan[name] = parts
    return plan


# the experts' projections as PEFT users name them: per expert (the planner's MLP targets) or stacked
EXPERT_TARGETS = (*LORA_MLP, "gate_up_proj")


def check_stacked_experts_untargeted(hf_config: Any, targets: list[str]) -> None:
    """A family whose checkpoint stacks each layer's experts in one tensor (gpt_oss: mlp.experts.gate_up_proj,
    down_proj) has no per-expert projection an adapter could be named after (PEFT adapts those stacks through
    `target_parameters`, another parameterisation): targeting the MLP projections is refused by name."""
    asked = sorted(set(targets) & set(EXPERT_TARGETS))
    if asked:
        raise LoRAError(f"trainer.lora.target_modules {asked}: LoRA on {hf_config.model_type}'s experts is not "
                        f"implemented (its checkpoint stacks each layer's experts in one tensor, with no projection "
                        f"of an expert's own to adapt); target its attention projections (q_proj, k_proj, v_proj, "
                        f"o_proj)")


def _peft_init(part: Part, rank: int, seed: int) -> torch.Tensor:
    """PEFT's A initialisation (kaiming_uniform_ with a = sqrt(5), as nn.Linear's weight), whole [r, in], from a
    generator seeded by the run's seed and the projection's name: the same adapter in every layout."""
    digest = hashlib.sha256(f"{seed}:{part.hf_module}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    bound = 1.0 / math.sqrt(part.in_features)  # kaiming_uniform_(a=sqrt(5)) on fan_in: gain sqrt(1/3) * sqrt(3/fan_in)
    return (torch.rand(rank, part.in_features, generator=gen, dtype=torch.float64) * 2 - 1).mul_(bound).float()


class Adapter(nn.Module):
    """The LoRA adapter of one Megatron linear (`base`, which it does not own): `delta(x)` is what it adds to the
    base's output; its `a.<i>` / `b.<i>` are part i's A and B (this rank's slices)."""

    def __init__(self, base: nn.Module, parts: list[Part], cfg: LoRAConfig, seed: int, dtype: torch.dtype):
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        super().__init__()
        self.column = isinstance(base, ColumnParallelLinear)
        self.parts, self.r, self.scaling = parts, cfg.rank, cfg.scaling
        self.tp_group = base.tp_group
        self.tp = self.tp_group.size() if self.tp_group is not None else 1
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False))
        self.expert = bool(getattr(base, "is_expert", False))  # one expert's linear (SequentialMLP)
        if getattr(base, "explicit_expert_comm", False) and self.tp > 1:
            raise LoRAError("LoRA on experts split by expert tensor parallelism is not implemented: their "
                            "outputs are partial sums reduced by the token dispatcher")
        if cfg.dropout > 0 and self.tp > 1:
            raise LoRAError("trainer.lora.dropout > 0 with trainer.parallel.tp > 1 is not implemented (every "
                            "tensor-parallel rank would have to draw the same mask)")
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.enabled = True
        self.a, self.b = nn.ParameterList(), nn.ParameterList()
        for part in parts:
            a = _peft_init(part, cfg.rank, seed)
            if self.column:
                self.b.append(nn.Parameter(torch.zeros(len(part.rows), cfg.rank, dtype=dtype)))
            else:  # A split along the input as the base is
                a = a.chunk(part.tp_size, dim=1)[part.tp_rank]
                self.b.append(nn.Parameter(torch.zeros(part.out_features, cfg.rank, dtype=dtype)))
            self.a.append(nn.Parameter(a.to(dtype).contiguous()))
        for p in self.b if not self.column else ():
            p.sequence_parallel = self.sequence_parallel  # finalize_model_grads sums its partial gradients
        for p in (*self.a, *self.b):  # an expert's: reduced over its expert-data-parallel group, as its weight is
            p.allreduce = getattr(base.weight, "allreduce", True)
        if self.tp > 1:  # the split parameters: Megatron counts each shard once in the gradient norm
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            for p in (self.b if self.column else self.a):
                set_tensor_model_parallel_attributes(p, is_parallel=True, dim=0 if self.column else 1, stride=1)
        if self.column:
            if base.gather_output:
                raise LoRAError("LoRA on a column-parallel linear that gathers its output is not implemented")
            self._out_local = base.weight.shape[0]
            for i, part in enumerate(parts):  # moved with the module (to its device), never saved
                self.register_buffer(f"rows_{i}", part.rows, persistent=False)

    def _b_full(self) -> torch.Tensor:
        """B of the whole linear [out_local, r * parts]: part i's B in its rows and columns, zero elsewhere."""
        if not self.column:
            return self.b[0]
        r = self.r
        big = self.b[0].new_zeros(self._out_local, r * len(self.parts))
        for i, b in enumerate(self.b):
            cols = torch.arange(i * r, (i + 1) * r, device=big.device)
            big = big.index_put((getattr(self, f"rows_{i}")[:, None], cols[None, :]), b)
        return big

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        a = torch.cat(list(self.a)) if len(self.a) > 1 else self.a[0]
        if self.column:
            if self.sequence_parallel:
                x = mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False,
                                                                  group=self.tp_group)
            h = torch.nn.functional.linear(self.dropout(x), a)
            if self.tp > 1:
                h = mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        else:
            h = torch.nn.functional.linear(self.dropout(x), a)
            if self.tp > 1 and self.sequence_parallel:
                h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
            elif self.tp > 1:
                h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return torch.nn.functional.linear(h, self._b_full()) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """scaling x B A in the base weight's local layout (merged publishing)."""
        a = torch.cat(list(self.a)) if len(self.a) > 1 else self.a[0]
        return (self._b_full() @ a) * self.scaling

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Column-parallel: B split along its rows (HF order per part); row-parallel: A along its columns."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        axes = {f"b.{i}": 0 for i in range(len(self.parts))} if self.column and self.tp > 1 else \
            {f"a.{i}": 1 for i in range(len(self.parts))} if self.tp > 1 else {}
        return make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"])


def _add_delta(linear: nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
    adapter = linear._tide_lora
    if not adapter.enabled:
        return output
    out, bias = output
    return out + adapter.delta(args[0] if args else kwargs["input_"]).to(out.dtype), bias


def attach(module: nn.Module, hf_config: Any, layout: RankLayout, cfg: LoRAConfig, seed: int) -> list[Adapter]:
    """Freeze `module` and give each targeted linear of its decoder layers an adapter (the only trainable
    parameters). Raises LoRAError when no linear matches trainer.lora.target_modules."""
    plan = plan_parts(module, hf_config, layout, cfg.target_modules)
    found = {p.target for parts in plan.values() for p in parts}
    if not found or (layout.pp_size == 1 and set(cfg.target_modules) - found):
        missing = sorted(set(cfg.target_modules) - found)
        raise LoRAError(f"trainer.lora.target_modules {missing} match no projection of this "
                        f"{hf_config.model_type} model's decoder layers")
    module.requires_grad_(False)
    adapters = []
    dtype = next(module.parameters()).dtype
    for name, parts in plan.items():
        linear = module.get_submodule(name)
        parent_name, _, child = name.rpartition(".")
        adapter = Adapter(linear, parts, cfg, seed, dtype).to(linear.weight.device)
        module.get_submodule(parent_name).add_module(child + SUFFIX, adapter)
        object.__setattr__(linear, "_tide_lora", adapter)  # not a submodule: registered once, beside the linear
        linear.register_forward_hook(_add_delta, with_kwargs=True)
        adapters.append(adapter)
    return adapters


def adapters(module: nn.Module) -> Iterator[tuple[str, Adapter]]:
    """(base linear name, adapter) for every adapter in `module`."""
    for name, m in module.named_modules():
        if isinstance(m, Adapter):
            yield name.removesuffix(SUFFIX), m


def is_adapter_parameter(name: str) -> bool:
    return any(part.endswith(SUFFIX) for part in name.split("."))


@contextmanager
def disabled(module: nn.Module):
    """The base model: every adapter off (LoRA's reference policy, no second copy of the weights)."""
    found = [a for _, a in adapters(module)]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a in found:
            a.enabled = True


def merged_parameters(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's base parameters with every adapter merged into its linear's weight (W + scaling B A), adapter
    parameters left out: what the family's converter turns into the served checkpoint."""
    deltas = {f"{name}.weight": a for name, a in adapters(module)}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if is_adapter_parameter(name):
                continue
            adapter = deltas.get(name)
            yield name, (p + adapter.delta_weight().to(p.dtype)) if adapter is not None else p


def peft_tensors(module: nn.Module, layout: RankLayout) -> Iterator[HFTensor]:
    """This rank's adapter as PEFT names them (`base_model.model.<module>.lora_A.weight` [r, in] and `lora_B`
    [out, r]), each a tensor-parallel shard along the base's split or whole (written by tensor-parallel rank 0, as
    replicated weights are); data-parallel replicas yield only on the first (experts' adapters: on the first
    expert-data-parallel replica), as the converter does."""
    lead = layout.tp_rank == 0
    for _, adapter in adapters(module):
        if not (layout.writes_experts if adapter.expert else layout.writes_dense):
            continue
        for part, a, b in zip(adapter.parts, adapter.a, adapter.b):
            stem = f"base_model.model.{part.hf_module}"
            a, b = a.detach(), b.detach()
            split = part.tp_size > 1
            if adapter.column:
                if lead:
                    yield HFTensor(f"{stem}.lora_A.weight", a)
                yield HFTensor(f"{stem}.lora_B.weight", b, part.tp_rank, part.tp_size, 0 if split else None)
            else:
                yield HFTensor(f"{stem}.lora_A.weight", a, part.tp_rank, part.tp_size, 1 if split else None)
                if lead:
                    yield HFTensor(f"{stem}.lora_B.weight", b)


def trainable_counts(module: nn.Module) -> tuple[int, int]:
    """(adapter parameters, all parameters) of this rank's module."""
    total = sum(p.numel() for p in module.parameters())
    return sum(p.numel() for n, p in module.named_parameters() if is_adapter_parameter(n)), total


class AdaptersOff(nn.Module):
    """The reference policy of a LoRA run: the policy's own module with its adapters off. It holds the module
    without registering it, so it has no parameters or state of its own (nothing to checkpoint or offload)."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        object.__setattr__(self, "policy", policy)

    def __getattr__(self, name: str):
        """What Megatron's schedules read of a model (config, model_type, set_input_tensor): the policy's."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.policy, name)

    def forward(self, *args, **kwargs):
        with disabled(self.policy):
            return self.policy(*args, **kwargs)
