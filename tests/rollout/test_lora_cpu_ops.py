"""rollout/lora_cpu_ops.py: the grouped CPU LoRA products give what vLLM's own torch ops give (one adapter for every
token, several, the last slot by index -1, 4-D stacks, accumulation or not, a slice of the output, padding), pass
the broadcast calls to vLLM's op, and are what vLLM's CPU punica wrapper calls once installed."""
from __future__ import annotations

import pytest
import torch

from rollout import lora_cpu_ops

SLOTS, R, IN, OUT = 3, 16, 48, 40


def _vllm_ops():
    from vllm.lora.ops.torch_ops import lora_ops

    lora_cpu_ops.install()  # keeps vLLM's own ops in _VLLM
    return {name: lora_cpu_ops._VLLM[name] for name in lora_cpu_ops.OPS} | {"module": lora_ops}


@pytest.fixture(scope="module")
def vllm_ops():
    return _vllm_ops()


INDICES = {"one adapter": [1] * 7, "mixed": [0, 2, 2, 1, 0, 2, 1], "last slot by -1": [-1, 0, -1, -1, 2, 0, -1]}


@pytest.mark.parametrize("indices", list(INDICES), ids=str)
@pytest.mark.parametrize("stacked_4d", [False, True])
def test_shrink_equals_vllms(vllm_ops, indices, stacked_4d):
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor(INDICES[indices])
    x = torch.randn(len(idx), IN, generator=g)
    a = torch.randn(SLOTS, R, IN, generator=g)
    if stacked_4d:
        a = a.unsqueeze(1)
    ours, theirs = torch.zeros(len(idx), R + 4), torch.zeros(len(idx), R + 4)  # a wider buffer: its tail untouched
    lora_cpu_ops.bgmv_shrink(x, a, ours, idx, 0.5)
    vllm_ops["bgmv_shrink"](x, a, theirs, idx, 0.5)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert ours[:, R:].abs().max() == 0 and ours[:, :R].abs().min() > 0


@pytest.mark.parametrize("indices", list(INDICES), ids=str)
@pytest.mark.parametrize("add_inputs", [False, True])
def test_expand_and_its_slice_equal_vllms(vllm_ops, indices, add_inputs):
    g = torch.Generator().manual_seed(1)
    idx = torch.tensor(INDICES[indices])
    h = torch.randn(len(idx), R, generator=g)
    b = torch.randn(SLOTS, 1, OUT, R, generator=g)
    start = torch.randn(len(idx), OUT + 8, generator=g)
    ours, theirs = start.clone(), start.clone()
    lora_cpu_ops.bgmv_expand(h, b, ours, idx, add_inputs)
    vllm_ops["bgmv_expand"](h, b, theirs, idx, add_inputs)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert not torch.equal(ours, start)
    ours, theirs = start.clone(), start.clone()
    lora_cpu_ops.bgmv_expand_slice(h, b, ours, idx, 4, OUT, add_inputs)
    vllm_ops["bgmv_expand_slice"](h, b, theirs, idx, 4, OUT, add_inputs)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours[:, :4], start[:, :4]) and torch.equal(ours[:, 4 + OUT:], start[:, 4 + OUT:])


def test_the_sgmv_ops_explode_their_indices_into_ours(vllm_ops):
    """Prefill: vLLM's sgmv ops repeat each sequence's adapter index over its tokens and call bgmv by name."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, IN, generator=g)
    a = torch.randn(SLOTS, 1, R, IN, generator=g)
    lens, adapters = torch.tensor([4, 2, 3]), torch.tensor([2, 0, 2])
    got = torch.zeros(9, R)
    vllm_ops["module"].sgmv_shrink(x, a, got, None, lens, adapters, 3, 4, 9, 2.0)
    want = torch.zeros(9, R)
    vllm_ops["bgmv_shrink"](x, a, want, torch.repeat_interleave(adapters, lens), 2.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_broadcast_call_goes_to_vllms_op(vllm_ops, monkeypatch):
    seen = []
    monkeypatch.setitem(lora_cpu_ops._VLLM, "bgmv_expand", lambda *args: seen.append(args))
    h, b = torch.randn(1, R), torch.randn(SLOTS, OUT, R)
    lora_cpu_ops.bgmv_expand(h, b, torch.zeros(5, OUT), torch.tensor([0, 1, 1, 2, 0]), True)  # one input row
    assert len(seen) == 1


def test_install_puts_them_where_vllms_cpu_wrapper_calls_them(vllm_ops):
    from vllm.lora.ops import torch_ops
    from vllm.lora.punica_wrapper import punica_cpu

    lora_cpu_ops.install()  # again: still vLLM's originals kept, not ours
    for name, op in lora_cpu_ops.OPS.items():
        assert getattr(punica_cpu, name) is op and getattr(torch_ops, name) is op
        assert getattr(vllm_ops["module"], name) is op and lora_cpu_ops._VLLM[name] is not op
