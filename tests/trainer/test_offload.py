"""Issue 62 item 4, the hybrid deployment's trainer side on CPU: a rank's parameters, gradients and optimizer state
out of its memory between phases (trainer/megatron/offload.py) and back, bit for bit, on a one-rank trainer built
in this process."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from tests.trainer.test_memory import _batch, _free_port
from trainer.batch import TrainBatch
from trainer.config import TrainerConfig, TrainerSpec

# float32 (Megatron's FP32Optimizer: the parameters are Adam's) with the frozen reference of trainer.kl; bfloat16
# with the distributed optimizer (parameters inside DDP's param buffer, fp32 main shards beside them)
LAYOUTS = {
    "float32_kl": ("float32", dict(kl={"coef": 0.1})),
    "bfloat16_distributed": ("bfloat16", dict(distributed_optimizer=True)),
}


@contextmanager
def worker(model_dir, dtype: str, **trainer):
    from trainer.megatron.worker import MegatronWorker

    w = MegatronWorker(TrainerSpec(hf_dir=str(model_dir), dtype=dtype,
                                   trainer=TrainerConfig(micro_batch_size=2, **trainer)), 0, 1, "127.0.0.1", _free_port())
    try:
        yield w
    finally:
        w.shutdown()


def _step(w, seed: int) -> dict[str, float]:
    batch: TrainBatch = _batch(seed)
    if w.reference is not None:  # trainer.kl: the reference's log-probs, as the loop attaches them
        ref = w.logprobs(batch, reference=True)  # {sequence index: log-probs}
        for i, seq in enumerate(batch.sequences):
            seq.ref_logprobs = ref[i]
    return w.train_step(batch, lr=1e-3)


def _state(w) -> dict[str, torch.Tensor]:
    """Everything a step leaves behind: parameters (policy and reference), their main_grad, the optimizer's main
    parameters and Adam's state."""
    from trainer.megatron.offload import _torch_optimizers

    out = {f"param.{n}": p.detach().clone() for n, p in w.module.named_parameters()}
    out |= {f"main_grad.{n}": p.main_grad.clone() for n, p in w.module.named_parameters()}
    if w.reference is not None:
        out |= {f"reference.{n}": p.detach().clone() for n, p in w.reference.named_parameters()}
    for i, inner in enumerate(_torch_optimizers(w)):
        for j, group in enumerate(inner.param_groups):
            for k, p in enumerate(group["params"]):
                out[f"main.{i}.{j}.{k}"] = p.detach().clone()
                out |= {f"adam.{i}.{j}.{k}.{name}": v.clone() for name, v in inner.state[p].items()}
    return out


def _round_trip_equals_no_round_trip(model_dir, dtype: str, **trainer) -> None:
    runs = {}
    for round_trip in (False, True):
        with worker(model_dir, dtype, **trainer) as w:
            first = _step(w, 0)
            w.parameter_digest()  # views the parameters through numpy, which makes their CPU storages fixed-size
            if round_trip:
                w.offload()
                w.onload()
            runs[round_trip] = (first, _step(w, 1), _state(w))
    (first, second, state), (first_rt, second_rt, state_rt) = runs[False], runs[True]
    assert first == first_rt and second == second_rt
    assert any(k.startswith("adam.") and k.endswith("exp_avg_sq") for k in state)  # Adam holds moments
    assert state.keys() == state_rt.keys()
    unequal = [k for k in state if not torch.equal(state[k], state_rt[k])]
    assert not unequal, unequal[:5]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_step_after_offload_and_onload_is_the_step_without(tiny_model_dir, layout):
    """step, offload, onload, step: the parameters, gradients and Adam state (and the step's statistics) are
    exactly those of step, step."""
    dtype, trainer = LAYOUTS[layout]
    _round_trip_equals_no_round_trip(tiny_model_dir, dtype, **trainer)


def test_an_moe_rank_round_trips_too(built_once):
    """qwen3_moe: the experts' parameters and their optimizer state come back bit for bit."""
    from rollout.tasks import AdditionTask
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    spec = TinyModelConfig(family="qwen3_moe", hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=32)
    model_dir = built_once("offload-qwen3-moe", lambda path: build_tiny_model(path, AdditionTask(1).corpus(), spec))
    _round_trip_equals_no_round_trip(model_dir, "bfloat16")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_offloaded_rank_holds_no_parameter_gradient_or_optimizer_storage(tiny_model_dir, layout):
    """While offloaded every parameter (policy and reference), main_grad, DDP buffer and optimizer tensor has a
    0-byte storage; the host copies hold exactly the bytes of the parameters and optimizer state (the gradients
    are not copied: the next step zeroes them); what needs the weights is refused by name; all come back."""
    from trainer.megatron.offload import OffloadedError, _ddp_buffers, _torch_optimizers

    dtype, trainer = LAYOUTS[layout]
    with worker(tiny_model_dir, dtype, **trainer) as w:
        _step(w, 0)
        digest = w.parameter_digest()

        def tensors() -> dict[str, torch.Tensor]:
            out = {f"param.{n}": p for n, p in w.module.named_parameters()}
            out |= {f"main_grad.{n}": p.main_grad for n, p in w.module.named_parameters()}
            if w.reference is not None:
                out |= {f"reference.{n}": p for n, p in w.reference.named_parameters()}
            for i, b in enumerate(_ddp_buffers(w)):
                out[f"grad_buffer.{i}"] = b.grad_data
                if b.param_data is not None:
                    out[f"param_buffer.{i}"] = b.param_data
            for i, inner in enumerate(_torch_optimizers(w)):
                for j, group in enumerate(inner.param_groups):
                    for k, p in enumerate(group["params"]):
                        out[f"main.{i}.{j}.{k}"] = p
                        out |= {f"adam.{i}.{j}.{k}.{n}": v for n, v in inner.state[p].items()}
            return out

        def distinct_bytes(names) -> int:
            storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                        for name, t in tensors().items() if any(name.startswith(n) for n in names)}
            return sum(storages.values())

        held = tensors()
        copied = distinct_bytes(("param", "reference", "main.", "adam."))
        grads = distinct_bytes(("main_grad", "grad_buffer"))
        assert copied > 0 and grads > 0
        out = w.offload()
        assert out["offload_bytes"] == copied
        assert out["released_bytes"] == copied + grads
        full = [name for name, t in held.items() if t.untyped_storage().nbytes() != 0]
        assert not full, full[:5]
        assert w._offloaded.host_bytes == copied
        with pytest.raises(OffloadedError, match="save_checkpoint"):
            w.save_checkpoint("unused")
        with pytest.raises(OffloadedError, match="train_step"):
            w.train_step(_batch(1), lr=1e-3)
        assert w.offload()["offload_bytes"] == 0  # twice: nothing more to do
        assert w.onload()["onload_bytes"] == copied
        assert w.onload()["onload_bytes"] == 0
        assert w.parameter_digest() == digest
        assert all(not p.main_grad.any() for p in w.module.parameters())  # zeroed, as the next step would
