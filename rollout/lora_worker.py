"""The grouped CPU LoRA ops (rollout/lora_cpu_ops.py) inside vLLM's workers. vLLM imports this module in every
worker process, an inline engine's own included, through the worker extension an engine serving adapters on cpu
names (rollout/lora_serving.py: LLM(worker_extension_cls=CPU_OPS_EXTENSION)), before the worker builds its model
and its LoRA layers: importing it is what installs them."""
from __future__ import annotations

from . import lora_cpu_ops

lora_cpu_ops.install()


class LoRAOpsExtension:
    """No methods: vLLM requires a class to mix into its worker; the module's import did the work."""
