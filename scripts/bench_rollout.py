"""Rollout throughput, with honest anchors: tide's rollout path against vLLM used directly, vLLM's other settings
that keep tide's log-prob contract, and Hugging Face `generate`. Figure of merit: generated tokens/s.

    .venv/bin/python scripts/bench_rollout.py [--quick]     writes bench_results/rollout.json

Sides, on the same model (a Qwen2-architecture decoder of about 100M parameters, random init, float32; --quick:
about 25M), prompts, sampling (temperature 1, no truncation, k samples per prompt, EOS or max_new_tokens) and
seeds, all alive at once and sampled round robin (one run, alternating):
- `tide`: what a rollout phase does -- the RolloutEngine as a Ray actor (orchestrator.workers.rollout_group) with tide's
  default engine settings, one seeded request with k samples per prompt, the sampled tokens' log-probs, Samples
  back to the driver;
- `vllm-direct`: vLLM's `LLM.generate` with tide's engine arguments and requests, timed around the call in the
  process that holds the engine (tide's overhead = the gap to this);
- vLLM variants that keep the contract (per-token log-probs of the sampled distribution, seeded samples), each
  `LLM` in its own process (an inline engine owns its process's distributed state), timed the same way:
  `vllm-request-per-sample` (k seeded requests per prompt), `vllm-separate-process` (vLLM's default process
  layout: engine core and model worker in child processes; tide's former default) and `vllm-compiled`
  (torch.compile instead of eager mode; its start-up cost is reported beside it);
- `vllm-onednn-cache-1024`: vLLM direct with oneDNN's default primitive cache, where tide caps it at 8 (the
  cache grew an engine by ~1 MB per iteration); the row `onednn_cache_capped_vs_default` is what the cap costs;
- `hf-generate`: transformers' `generate` on the whole batch, with the sampled tokens' log-probs.
Tokens are counted as generated (up to and including EOS). No roofline is printed: a bound computed from
kernels other than vLLM's was exceeded by vLLM in an earlier version of this script.
"""
from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Report, bench_arguments, repeats_for, timed  # noqa: E402

HF_TARGET = 2.0  # tide vs transformers generate, full mode at ~100M
DIRECT_TARGET = 0.95  # tide's path vs vLLM called directly with the same settings
# vLLM's workers keep spinning on their shared-memory queue for 1 s after their last step
# (vllm/distributed/device_communicators/shm_broadcast.py, SpinCondition.busy_loop_s): waiting this long before
# each sample keeps one side's spinning engine from taking the cores of the next side's run.
IDLE_S = 1.2


def build_model(tmp: Path, quick: bool) -> Path:
    from rollout.tasks import AdditionTask
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    # ~104M parameters (12 x 8.7M per layer); quick: ~25M
    hidden, layers, inter = (512, 6, 2048) if quick else (768, 12, 3072)
    spec = TinyModelConfig(hidden_size=hidden, num_layers=layers, num_heads=hidden // 64, num_kv_heads=4,
                           intermediate_size=inter, max_position_embeddings=512)
    return build_tiny_model(tmp / "model", AdditionTask(4).corpus(), spec)


class HFGenerate:
    """transformers' generate on the whole batch, with the sampled tokens' raw log-probs."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def __call__(self, prompts: list[str], n: int, max_new_tokens: int, seed: int) -> int:
        torch = self.torch
        torch.manual_seed(seed)
        batch = self.tok(prompts, return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = self.model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                      num_return_sequences=n, max_new_tokens=max_new_tokens,
                                      return_dict_in_generate=True, output_logits=True,
                                      pad_token_id=self.tok.pad_token_id, eos_token_id=self.tok.eos_token_id)
            new = out.sequences[:, batch["input_ids"].shape[1]:]
            logits = torch.stack(out.logits, dim=1)  # [B, T, V] raw logits, what tide returns log-probs of
            logprobs = torch.log_softmax(logits.float(), -1).gather(-1, new[..., None])[..., 0]
        eos = self.tok.eos_token_id
        produced = 0
        for row in new.tolist():  # tokens up to and including the first EOS
            produced += row.index(eos) + 1 if eos in row else len(row)
        assert logprobs.shape == new.shape
        return produced


def _produced(outputs) -> int:
    n = 0
    for out in outputs:
        for c in out.outputs:
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
            n += len(c.token_ids)
    return n


def _vllm_worker(conn, model_dir: str, cfg_json: str, problems, n_samples: int, max_new: int) -> None:
    """One vLLM `LLM` with the given engine settings, in its own process. Answers ("tide" | "per-sample", seed)
    with the tokens/s of one `LLM.generate` of the problems, timed around the call; None ends it."""
    import gc

    from vllm import SamplingParams, TokensPrompt

    from rollout.config import EngineConfig
    from rollout.engine import configure_env, generate_requests, llm_kwargs, prompt_seed

    cfg = EngineConfig.model_validate_json(cfg_json)
    configure_env(cfg)
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model_dir, **llm_kwargs(cfg, "float32", 0, False))
    gc.collect()
    gc.freeze()  # as tide's engine actor does after start-up
    conn.send(time.perf_counter() - t0)
    while (msg := conn.recv()) is not None:
        requests, seed = msg
        if requests == "tide":
            reqs, params = generate_requests(problems, n_samples, max_new, 1.0, seed)
        else:  # one seeded request per sample
            reqs = [TokensPrompt(prompt_token_ids=list(p.prompt_ids)) if p.prompt_ids else p.prompt
                    for p in problems for _ in range(n_samples)]
            params = [SamplingParams(n=1, max_tokens=max_new, temperature=1.0, seed=prompt_seed(seed, i) + j,
                                     logprobs=0, detokenize=False)
                      for i in range(len(problems)) for j in range(n_samples)]
        got = []
        s = timed(lambda: got.append(llm.generate(reqs, params, use_tqdm=False)))
        conn.send(_produced(got[0]) / s)
    if cfg.engine_process == "separate":
        llm.llm_engine.engine_core.shutdown()


class VLLMProcess:
    """A `_vllm_worker` process: started at once, `ready()` waits for its engine."""

    def __init__(self, model_dir: Path, cfg, problems, n_samples: int, max_new: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_vllm_worker,
                                args=(child, str(model_dir), cfg.model_dump_json(), problems, n_samples, max_new))
        self.proc.start()

    def ready(self, timeout: float = 900) -> float:
        if not self.conn.poll(timeout):
            raise RuntimeError("a vLLM worker process did not start its engine")
        return self.conn.recv()

    def rate(self, requests: str, seed: int) -> float:
        self.conn.send((requests, seed))
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()


def main() -> None:
    args = bench_arguments(__doc__).parse_args()

    import ray

    from orchestrator.workers.rollout_group import RolloutGroup
    from rollout.config import EngineConfig
    from rollout.tasks import AdditionTask
    from trainer.batch import TokenDistribution

    quick = args.quick
    repeats = repeats_for(quick)
    n_prompts, n_samples, max_new = (16, 4, 32) if quick else (64, 4, 64)
    report = Report("rollout", quick)
    tmp = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    group, workers = None, {}
    try:
        model_dir = build_model(tmp, quick)
        problems = AdditionTask(4).problems(seed=0, iteration=1, n=n_prompts)
        prompts = [p.prompt for p in problems]
        cfg = EngineConfig(kv_cache_gb=1.0)
        variants = {"vllm-direct": cfg, "vllm-separate-process": cfg.model_copy(update={"engine_process": "separate"}),
                    "vllm-compiled": cfg.model_copy(update={"enforce_eager": False}),
                    # tide caps oneDNN's primitive cache at 8 (rollout/engine_setup.py): its default, 1024
                    "vllm-onednn-cache-1024": cfg.model_copy(
                        update={"extra_env": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}})}
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
        starts = {}
        for name, variant in variants.items():  # one at a time: each start is timed alone
            workers[name] = VLLMProcess(model_dir, variant, problems, n_samples, max_new)
            starts[name] = workers[name].ready()
        t0 = time.perf_counter()
        group = RolloutGroup([str(model_dir)], cfg, dtype="float32", seed=0, deterministic=False)
        group.wait_started()
        starts["tide"] = time.perf_counter() - t0
        hf = HFGenerate(model_dir)
        seeds = iter(range(10_000))

        def tide() -> float:
            got = []
            s = timed(lambda: got.append(group.generate(problems, n_samples, max_new, TokenDistribution(), next(seeds))))
            return sum(len(x.completion_ids) for x in got[0].items) / s

        def vllm(name: str, requests: str = "tide"):
            return lambda: workers[name].rate(requests, next(seeds))

        def hf_generate() -> float:
            got = []
            s = timed(lambda: got.append(hf(prompts, n_samples, max_new, next(seeds))))
            return got[0] / s

        sides = {"tide": tide, "vllm-direct": vllm("vllm-direct"),
                 "vllm-request-per-sample": vllm("vllm-direct", "per-sample"),
                 "vllm-separate-process": vllm("vllm-separate-process"), "vllm-compiled": vllm("vllm-compiled"),
                 "vllm-onednn-cache-1024": vllm("vllm-onednn-cache-1024"), "hf-generate": hf_generate}
        for fn in sides.values():  # warm-up
            fn()
        samples: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(repeats):  # round robin: every side sees the same machine state
            for name, fn in sides.items():
                time.sleep(IDLE_S)
                samples[name].append(fn())
        params = sum(p.numel() for p in hf.model.parameters())
        extra = dict(parameters=params, prompts=n_prompts, samples_per_prompt=n_samples, max_new_tokens=max_new)
        unit = "generated tokens/s"
        direct_row = report.add("tide_vs_vllm_direct", "tide rollout path (Ray actor, RolloutEngine)",
                                "vLLM LLM.generate, tide's engine arguments and requests", unit,
                                samples["tide"], samples["vllm-direct"], **extra)
        variant_names = ("vllm-direct", "vllm-request-per-sample", "vllm-separate-process", "vllm-compiled")
        best_name = max(variant_names, key=lambda k: statistics.median(samples[k]))
        report.add("onednn_cache_capped_vs_default", "vLLM direct, oneDNN primitive cache capped at 8 (tide's)",
                   "vLLM direct, oneDNN's default cache (1024 primitives)", unit, samples["vllm-direct"],
                   samples["vllm-onednn-cache-1024"], **extra)
        for name, what in (("vllm-request-per-sample", "one seeded request per sample"),
                           ("vllm-separate-process", "engine core and worker in child processes (vLLM's default)"),
                           ("vllm-compiled", "enforce_eager=False (torch.compile)")):
            report.add(f"{name}_vs_vllm_direct", f"vLLM direct, {what}", "vLLM direct, tide's settings", unit,
                       samples[name], samples["vllm-direct"], **extra)
        best_row = report.add("tide_vs_fastest_vllm", "tide rollout path", f"fastest vLLM configuration ({best_name})",
                              unit, samples["tide"], samples[best_name], **extra)
        hf_row = report.add("tide_vs_hf_generate", "tide rollout path", "transformers generate", unit,
                            samples["tide"], samples["hf-generate"], **extra)
        report.note("engine_start_s", {k: round(v, 1) for k, v in starts.items()})
        # Compiled mode pays its compile at every engine start (and restart-mode sync): the tokens after which its
        # faster decoding has paid that back, against tide's eager default
        eager, compiled_rate = statistics.median(samples["vllm-direct"]), statistics.median(samples["vllm-compiled"])
        saved_per_token = 1 / eager - 1 / compiled_rate
        extra_start = starts["vllm-compiled"] - starts["vllm-direct"]
        tokens = extra_start / saved_per_token if saved_per_token > 0 else math.inf
        report.note("compiled_break_even", {"extra_start_s": extra_start, "tokens": tokens,
                                            "eager_generation_s": tokens / eager})
        report.note("tide_engine_settings", {"engine_process": cfg.engine_process, "enforce_eager": cfg.eager})
        report.goal("tide_path_vs_vllm_direct (same settings)", direct_row["ratio"], DIRECT_TARGET, row=direct_row)
        report.goal("tide_default_vs_fastest_vllm", best_row["ratio"], 1.0, row=best_row)
        if not quick:
            report.goal("tide_vs_hf_generate (full mode, ~100M)", hf_row["ratio"], HF_TARGET, row=hf_row)
    finally:
        if group is not None:
            group.shutdown()
        for w in workers.values():
            w.close()
        shutil.rmtree(tmp, ignore_errors=True)
    report.finish()


if __name__ == "__main__":
    main()
