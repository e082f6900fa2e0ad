"""trainer/megatron/compat.py on CPU: the device-rewriting TorchFunctionMode stays on for Megatron's own code (a
literal device='cuda' lands on the CPU) and is off inside the torch optimizer's step and tide's loss functions,
whose many small ops it only slowed (compat.native_torch_steps, rank._natively). Process-wide, so in a subprocess."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import json, types, torch
from trainer.megatron.compat import enable_cpu_compat, native_torch_steps
from trainer.megatron.rank import _natively

enable_cpu_compat()
seen = {"outside": torch._C._is_torch_function_enabled(), "cuda_tensor": str(torch.zeros(1, device="cuda").device)}
param = torch.nn.Parameter(torch.ones(3))
adam = torch.optim.Adam([param], lr=0.1)
adam.register_step_pre_hook(lambda opt, args, kwargs: seen.update(in_step=torch._C._is_torch_function_enabled()))
chained = types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=adam)])
native_torch_steps(chained)
param.grad = torch.ones(3)
adam.step()
seen["stepped"] = param.detach().tolist()
seen["in_loss"] = _natively(lambda mb, out: torch._C._is_torch_function_enabled(), {}, None)
seen["after"] = torch._C._is_torch_function_enabled()
print(json.dumps(seen))
"""


def test_the_mode_is_off_in_the_optimizer_step_and_the_loss_and_on_elsewhere():
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["outside"] and seen["after"] and seen["cuda_tensor"] == "cpu"  # Megatron's literal 'cuda' rewritten
    assert seen["in_step"] is False and seen["in_loss"] is False
    assert all(abs(x - 0.9) < 1e-6 for x in seen["stepped"])  # Adam's first step: lr x sign(grad)
