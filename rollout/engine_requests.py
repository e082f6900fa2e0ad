"""What one rollout call asks vLLM, and what vLLM's answer becomes: the prompts and sampling parameters of a
generate call (seeded per prompt, so that a sample does not depend on batching or restarts) and its outputs as
Samples; the requests of a teacher-forced scoring call and the log-probs it returns. vLLM is imported where a
request is built."""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

from . import routing_capture
from .engine_errors import EngineError
from .in_flight import token_versions
from .samples import Sample, Samples
from .tasks.base import Problem


def prompt_seed(seed: int, prompt_index: int) -> int:
    """Sampling seed of a prompt's request: a pure function of (seed, prompt). vLLM seeds the request's
    sample j with prompt_seed + j, so a sample does not depend on how requests are batched or whether the
    engine was restarted in between."""
    digest = hashlib.blake2b(f"{seed}/{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**62 - 1)  # + j stays a 63-bit seed


def generate_requests(problems: Sequence[Problem], n_samples: int, max_new_tokens: int, temperature: float, seed: int,
                      top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] = (),
                      stop_token_ids: Sequence[int] = ()) -> tuple[list, list]:
    """The vLLM prompts and SamplingParams of one generate call: one request per prompt for its `n_samples`
    samples (vLLM fans it out: fewer requests to build, send and schedule; scripts/bench_rollout.py compares
    it with a request per sample), seeded by prompt_seed (or the problem's own seed and token budget, where a
    multi-turn rollout sets them), asking for the sampled tokens' log-probs."""
    from vllm import SamplingParams, TokensPrompt

    params = [
        SamplingParams(
            n=n_samples, max_tokens=p.max_new_tokens or max_new_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=prompt_seed(seed, i) if p.seed is None else p.seed, logprobs=0, stop=list(stop) or None,
            stop_token_ids=list(stop_token_ids) or None, detokenize=bool(stop),  # vLLM matches stop text
        )
        for i, p in enumerate(problems)
    ]
    prompts = [TokensPrompt(prompt_token_ids=list(p.prompt_ids)) if p.prompt_ids else p.prompt for p in problems]
    return prompts, params


def samples_from_outputs(outputs: Sequence[Any], problems: Sequence[Problem], n_samples: int, tokenizer: Any,
                         routing: dict, routing_recorded: bool, first_version: int | None = None) -> Samples:
    """The Samples of a generate call's RequestOutputs (in request order: Sample.prompt_index = problem index).
    `routing`: recorded routing by (request id, sample index), required of every sample when `routing_recorded`.
    `first_version`: the version that sampled the first tokens of a call that took weights in flight (each
    sample then carries its tokens' versions); None otherwise."""
    # One decode of the whole completion (vLLM's incremental detokenizer holds back a trailing partial
    # UTF-8 sequence); special tokens such as EOS are dropped.
    items = []
    for i, out in enumerate(outputs):
        if len(out.outputs) != n_samples:
            raise EngineError(f"vLLM returned {len(out.outputs)} completions for {n_samples} samples")
        prompt_ids = list(out.prompt_token_ids)
        experts = [routing.get((out.request_id, c.index)) for c in out.outputs]
        if routing_recorded:
            if any(e is None for e in experts):
                raise EngineError(f"no routing was recorded for a sample of request {out.request_id}")
            routing_capture.fill_shared_prefix(experts, len(prompt_ids))
        for c, routed in zip(out.outputs, experts):  # in sample order
            ids = list(c.token_ids)
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise EngineError(f"vLLM returned {len(c.logprobs or [])} log-probs for {len(ids)} tokens")
            text = tokenizer.decode(ids, skip_special_tokens=True)
            if isinstance(c.stop_reason, str) and c.stop_reason in text:
                text = text[:text.index(c.stop_reason)]
            items.append(Sample(
                prompt_index=i, task_id=problems[i].task_id, prompt_ids=list(prompt_ids),
                completion_ids=ids, logprobs=[_token_logprob(e, t) for e, t in zip(c.logprobs, ids)],
                text=text, answer=problems[i].answer, finish_reason=str(c.finish_reason or ""),
                routed_experts=routed, versions=None if first_version is None else token_versions(
                    c.weight_versions, len(ids), first_version),
            ))
    return Samples(items)


def score_requests(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                   todo: Sequence[int]) -> tuple[list, Any]:
    """The vLLM prompts (prompt + completion of each sequence in `todo`) and SamplingParams of a teacher-forced
    scoring call: one token generated, greedily, and the raw log-prob of every prompt token."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=list(prompt_ids[k]) + list(completion_ids[k])) for k in todo]
    return prompts, params


def completion_logprobs(output: Any, prompt_len: int, completion: Sequence[int]) -> list[float]:
    """The log-probs of a scored sequence's completion tokens, from its RequestOutput's prompt log-probs."""
    entries = output.prompt_logprobs[prompt_len:prompt_len + len(completion)]
    return [_token_logprob(e, t) for e, t in zip(entries, completion)]


def _token_logprob(entry: Any, token: int) -> float:
    return float(entry[token].logprob)
