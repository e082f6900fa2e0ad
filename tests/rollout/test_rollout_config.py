"""The engines' settings as vLLM gets them: `enforce_eager: auto` resolved from the run's size against the
measured compile break-even (compiled on GPUs), and the KV cache as bytes on CPU or a share of GPU memory."""
import pytest
from pydantic import ValidationError

from rollout.config import COMPILED_BREAK_EVEN_TOKENS, DEFAULT_CPU_KV_CACHE_GB, EngineConfig, RolloutConfig
from rollout.engine import llm_kwargs


def _rollout(**kw) -> RolloutConfig:
    return RolloutConfig(prompts_per_iteration=64, n_samples=8, max_new_tokens=4, **kw)  # 2048 tokens / iteration


def test_auto_compiles_on_cpu_only_past_the_break_even():
    per_iteration = 64 * 8 * 4
    below = COMPILED_BREAK_EVEN_TOKENS // per_iteration  # the whole run's tokens stay under the break-even
    assert _rollout().engine_config(below).enforce_eager is True
    assert _rollout().engine_config(below + 1).enforce_eager is False
    # restart syncs start (and compile) the engine every iteration: one iteration's tokens decide
    assert _rollout(sync_mode="restart").engine_config(10 * below).enforce_eager is True
    # two engines split the prompts: each generates half
    assert _rollout(engines=2).engine_config(below + 1).enforce_eager is True
    assert _rollout(enforce_eager=True).engine_config(100 * below).enforce_eager is True  # set by the user: kept
    assert _rollout(enforce_eager=False).engine_config(1).enforce_eager is False
    assert _rollout(device="cuda").engine_config(1).enforce_eager is False  # CUDA graphs
    assert EngineConfig().eager is True and EngineConfig(device="cuda").eager is False


def test_kv_cache_is_bytes_on_cpu_and_a_memory_share_on_gpus():
    cpu = llm_kwargs(EngineConfig(), "float32", 0, True)
    assert cpu["kv_cache_memory_bytes"] == int(DEFAULT_CPU_KV_CACHE_GB * 2**30) and "gpu_memory_utilization" not in cpu
    assert llm_kwargs(EngineConfig(kv_cache_gb=1.5), "float32", 0, True)["kv_cache_memory_bytes"] == int(1.5 * 2**30)
    gpu = llm_kwargs(EngineConfig(device="cuda", gpu_memory_utilization=0.7), "bfloat16", 0, False)
    assert gpu["gpu_memory_utilization"] == 0.7 and "kv_cache_memory_bytes" not in gpu
    assert gpu["enforce_eager"] is False
    with pytest.raises(ValidationError, match="gpu_memory_utilization applies to device 'cuda' only"):
        EngineConfig(gpu_memory_utilization=0.5)
