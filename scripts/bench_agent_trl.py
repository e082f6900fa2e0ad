"""The TRL side of the tool-use benchmark: TRL's GRPOTrainer with `tools=` on tide's tool-use job
(configs/tool_calc.yaml: products of two 2-digit numbers, a tiny byte-level model, a `python` tool run in tide's code
sandbox, Hermes-style `<tool_call>{json}</tool_call>` calls). The figure it feeds: time and iterations until the
5-iteration moving average of training reward reaches 0.5, tide against TRL, same job, same settings.

The same job on both sides, read from the config:
- the same tiny model directory tide builds, and the same supervised warm start: tide's own demonstration
  sequences (`Agent.demonstrations`: token ids and per-token loss masks, the model's turns only), trained in plain
  PyTorch as tide's trainer trains them (token-mean NLL over the masked tokens, Adam at trainer.warmup_sft_lr,
  trainer.warmup_sft_batch per step, gradient clipping, ended by trainer.warmup_sft_stop_loss as tide ends it);
  the RL optimizer starts fresh afterwards;
- the same prompts in the same order (`task.problems(seed, it, prompts_per_iteration)`), the same messages and tool
  schema, rendered to the same token ids (checked at start-up: a mismatch stops the run);
- rollout.n_samples trajectories per prompt (`num_generations`), trainer.updates_per_iteration optimizer steps per
  iteration (`steps_per_generation`), lr with its warm-up (`warmup_steps` = warmup_iterations x updates), tide's
  `grpo` + `seq_mean_token_mean` as `loss_type="grpo"`, `adv_std_norm` as `scale_rewards="group"`, the clip range
  as `epsilon`/`epsilon_high`, no KL (`beta=0.0`), the sampling temperature / top_p / top_k, fp32 on CPU,
  gradient clipping (`max_grad_norm`), weight decay, the seed;
- multi-turn limits: agent.max_turns as `max_tool_calling_iterations = max_turns - 1`; agent.max_total_tokens
  (tide counts everything after the prompt: sampled turns and inserted tool results) as `max_completion_length`;
  agent.max_tokens_per_turn as `generation_kwargs={"max_new_tokens": ...}`, which TRL applies to every turn;
- the tool: `python(code: str) -> str` with tide's docstring (the same JSON schema), executed by tide's own code:
  one tide tool episode per call (`ToolBox` + `PythonSession`: a fresh sandbox session per call, closed after it),
  the same cell timeout and memory limit, errors worded as tide words them, the output cut to its first
  agent.max_tool_response_tokens tokens by tide's runner (`AgentRunner._clip`, same tokenizer, same cut note);
- the reward: `task.score` on the text of the trajectory's last model turn, as tide scores it (a last turn that
  still calls a tool is scored with its call text, so it scores 0 as in tide);
- TRL masks the tool results out of the loss (`tool_mask`), as tide masks inserted tokens.

Chat template. The tiny model's template (trainer/tiny_model.py TINY_CHAT_TEMPLATE) writes only a message's
`content`, so a structured `tool_calls` message renders without its call: `trl.chat_template_utils.
supports_tool_calling` is False and GRPOTrainer refuses it (`is_chat_template_prefix_preserving` is True). TRL gets
the same template with one addition: an assistant message's `tool_calls` written after its content exactly as
tide's hermes parser formats them (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, what tide's
demonstrations write). Messages without `tool_calls` -- every prompt and tool result -- render identically, and
TRL builds its multi-turn sequences by concatenating sampled ids with the suffix the template adds after a tool
message, so every token TRL trains on is a token tide's layout has in the same place. The tokenizer gets a
`response_template` (transformers >= 5.13) that parses the Hermes format tide's parser reads.

Where the two sides cannot be equal (TRL offers no setting for these):
- sampling: tide samples on vLLM with a seed per turn per trajectory; TRL on transformers' `generate` with torch's
  global generator: same distribution, different draws;
- tool calls: tide runs a trajectory's calls concurrently with the others' and keeps one sandbox session per
  trajectory (variables survive between its calls); TRL calls tools one trajectory after another, and its tools are
  stateless: a session per call. A malformed call (not JSON, no name) goes back to the model as an error in tide
  and the trajectory goes on; TRL's parser falls back to plain text and the trajectory ends there. A turn cut at
  max_tokens_per_turn ends the trajectory in tide; TRL still runs a complete call in it;
- budgets: tide gives each turn min(max_tokens_per_turn, what is left of max_total_tokens) and ends a trajectory
  whose next tool result would reach max_total_tokens; TRL generates up to max_tokens_per_turn and cuts the turn
  to what is left, and drops a tool result only when it passes max_completion_length (> rather than >=);
- learning-rate warm-up: tide's is per iteration (iteration k of w at lr x k / w); TRL's per optimizer step
  (step s of w x updates at lr x s / (w x updates): the first step at lr 0);
- advantages: tide divides by the group's population std (+ adv_std_eps 1e-6), TRL by the unbiased std (+ 1e-4);
- tide takes no optimizer step on a mini-batch whose advantages are all zero; TRL steps anyway (Adam's momentum);
- the optimizers: tide's is Megatron's Adam, TRL's torch's AdamW, the warm start's torch's Adam (weight decay as
  configured, 0 here). The warm start's first loss equals tide's to the last digit (same model, same batch); from
  the second step on the two differ by ~1e-4 (float order in two different implementations, amplified by Adam), so
  the two warm-started policies are alike, not identical;
- mini-batches: both shuffle each iteration's trajectories before cutting them, with different permutations.

    python scripts/bench_agent_trl.py --warmup-steps 20 --iterations 2   # a smoke test (no tool calls yet)
    python scripts/bench_agent_trl.py --iterations 3                     # the config's warm start, 3 iterations

scripts/bench_agent.py --parts trl runs both sides against each other.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import yaml

from bench_common import ROOT, sft_steps
TOOL_CALC = ROOT / "configs" / "tool_calc.yaml"


def hermes_chat_template(template: str) -> str:
    """`template` (the tiny model's) with an assistant message's `tool_calls` written after its content as tide's
    hermes parser formats them (rollout/agent/parsers.py HermesParser.format); everything else renders as before."""
    content = "{{ m['content'] }}"
    if template.count(content) != 1:
        raise ValueError("the chat template no longer writes a message's content once as {{ m['content'] }}: "
                         "extend hermes_chat_template to the new template")
    calls = ("{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, "
             "'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}")
    return template.replace(content, content + calls)


def hermes_response_template(generation_prompt: str, end_of_turn: str) -> dict[str, Any]:
    """A transformers `response_template` for a turn written after `generation_prompt` and ended by `end_of_turn`:
    its `<tool_call>{json}</tool_call>` blocks as OpenAI tool calls, the text around them as its content."""
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": generation_prompt,
        "fields": {
            "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "repeats": True, "content": "json",
                           "transform": {"type": "function", "function": "{content}"}},
            # the text before, between and after the calls (each piece stripped), joined
            "content": {"close": end_of_turn, "content": "text", "repeats": True, "join": ""},
        },
    }


def generation_prompt(tokenizer) -> str:
    """What the chat template writes to open the model's turn (the tiny template's `assistant: `)."""
    messages = [{"role": "user", "content": "?"}]
    closed = tokenizer.apply_chat_template(messages, tokenize=False)
    opened = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not opened.startswith(closed) or opened == closed:
        raise ValueError(f"the chat template's generation prompt cannot be told: {closed!r} -> {opened!r}")
    return opened[len(closed):]


def last_turn_text(completion: list[dict[str, Any]]) -> str:
    """The text of a trajectory's last model turn as tide scores it (rollout/agent/runner.py Sample.text): its
    content, and any tool call it still makes written out as the model wrote it."""
    from rollout.agent import ToolCall, get_parser

    turn = next((m for m in reversed(completion) if m.get("role") == "assistant"), {})
    calls = [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in turn.get("tool_calls") or []]
    return (turn.get("content") or "") + (get_parser("hermes").format(calls) if calls else "")


def tide_python_tool(agent, counts: Counter,
                     harness_errors: list[str]) -> Callable[[str], Coroutine[Any, Any, str]]:
    """TRL's `python` tool, run by tide's own code: each call is a tide tool episode of its own (a fresh sandbox
    session, tide's ToolBox limits and error wording), its output cut as tide's runner cuts a tool result. An
    exception of the harness itself (not of the code it runs) is appended to `harness_errors`: TRL answers the model
    with it as a tool error and trains on, so the caller fails the run on it instead."""
    from rollout.agent import AgentRunner, PythonSession, ToolCall
    from rollout.tasks import Problem

    clip = AgentRunner(None, agent.tokenizer, agent.limits)._clip
    problem = Problem("tool", "", "", messages=({"role": "user", "content": ""},))

    async def python(code: str) -> str:
        try:
            episode = agent.episode(problem, Counter())
            try:
                outcome = await episode.tools.call(ToolCall("python", {"code": code}))
            finally:
                await episode.close()
        except Exception as e:  # the harness's own failure (the code's are outcomes): TRL would hand it to the model
            harness_errors.append(f"{type(e).__name__}: {e}")
            raise
        counts["calls"] += 1
        counts["failed"] += outcome.failure is not None
        return clip({"role": "tool", "content": outcome.text})["content"]

    python.__doc__ = PythonSession.python.__doc__  # tide's description: the same JSON schema
    return python


def warm_start(model, tc, task, renderer, agent) -> None:
    """The job's supervised warm start (orchestrator/iteration/warmup.py) in plain PyTorch (bench_common.sft_steps) on
    tide's own demonstration sequences: `agent.demonstrations` lays out each written conversation as tide's warm start
    does, token ids and per-token loss masks, the model's turns only."""
    t = tc.trainer
    conversations = task.sft_conversations(tc.seed, t.warmup_sft_steps * t.warmup_sft_batch)
    sequences = agent.demonstrations(conversations, renderer.end_of_turn_ids())
    losses = sft_steps(model, sequences, t.warmup_sft_batch, t.warmup_sft_steps, t.warmup_sft_lr, t.weight_decay,
                       t.grad_clip, renderer.tokenizer.pad_token_id, t.warmup_sft_stop_loss)
    print(f"supervised warm start: {len(losses)} steps, loss {losses[0]:.6f} -> {losses[-1]:.6f}", flush=True)


def run_trl_tools(cfg: dict, work: Path, clock: list[float] | None = None, *,
                  tool_calls: list[float] | None = None) -> list[float]:
    """TRL's GRPOTrainer with `tools=` on the tool-use job `cfg` (a tide config as a dict, e.g. configs/tool_calc.yaml
    loaded with yaml.safe_load); returns the mean reward of every generation (one per iteration). A sandbox service
    is started under `work` for the run and stopped at its end. `clock`, when given, receives time.time() when
    training starts and when each generation is scored; `tool_calls`, the tool calls per trajectory of each
    generation."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import get_json_schema
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    from orchestrator.agents.agent_rollout import Agent
    from orchestrator.config.schema import parse_config
    from orchestrator.config.model_source import resolve_model_dir
    from orchestrator.workers.prompts import PromptRenderer, with_system_prompt
    from orchestrator.workers.sandbox_service import SandboxService
    from orchestrator.iteration.session import _model_context
    from rollout.tasks import Problem, make_task

    tc = parse_config(cfg, "run_trl_tools", ROOT / "configs")
    if tc.agent is None or tc.agent.tools != ["python"]:
        raise ValueError("run_trl_tools runs agent jobs with the python tool only (agent.tools: [python])")
    seed, t, r, a = tc.seed, tc.trainer, tc.rollout, tc.agent
    if t.kl.coef != 0 or t.loss != "grpo" or t.loss_agg != "seq_mean_token_mean" or t.epochs != 1:
        raise ValueError("TRL's loss_type 'grpo' is tide's loss grpo with loss_agg seq_mean_token_mean, one epoch, "
                         "no KL")
    if t.lr_schedule.decay != "constant" and t.lr_schedule.min_lr != 0:
        raise ValueError("TRL's linear and cosine schedules decay to 0: set trainer.lr_schedule.min_lr to 0")
    work.mkdir(parents=True, exist_ok=True)
    task = make_task(tc.task)
    model_dir = resolve_model_dir(tc.model.path, tc.model.tiny, task, seed)
    renderer = PromptRenderer(AutoTokenizer.from_pretrained(model_dir), tc.model.chat_template, tc.model.system_prompt)
    context = _model_context(model_dir, tc)

    sandbox = SandboxService.start(work, tc.sandbox.state_dir) if not tc.sandbox.url else None
    agent = None
    try:
        agent = Agent(a, AutoTokenizer.from_pretrained(model_dir), renderer.template, tc.model.system_prompt,
                      r.max_new_tokens, tc.sandbox.url or sandbox.url, tc.task.name, context, tc.deterministic)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if t.warmup_sft_steps:
            warm_start(model, tc, task, renderer, agent)

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        template_checks = {"supports_tool_calling": supports_tool_calling(tokenizer),
                           "is_chat_template_prefix_preserving": is_chat_template_prefix_preserving(tokenizer)}
        print(f"the tiny chat template under TRL's checks: {template_checks}", flush=True)
        tokenizer.chat_template = hermes_chat_template(renderer.template)
        eos = tokenizer.decode(renderer.end_of_turn_ids() or [tokenizer.eos_token_id])
        tokenizer.response_template = hermes_response_template(generation_prompt(tokenizer), eos)

        counts: Counter = Counter()
        harness_errors: list[str] = []
        python = tide_python_tool(agent, counts, harness_errors)
        if get_json_schema(python) != agent.schemas[0]:
            raise RuntimeError(f"the python tool's schema differs from tide's: {get_json_schema(python)} vs "
                               f"{agent.schemas[0]}")
        problems = [p for it in range(1, tc.iterations + 1) for p in task.problems(seed, it, r.prompts_per_iteration)]
        dataset = Dataset.from_list([{"prompt": with_system_prompt(p.messages, tc.model.system_prompt),
                                      "answer": p.answer} for p in problems])
        rewards_per_call: list[float] = []
        calls_before = [0]

        def harness_ok() -> None:  # TRL's side would be measured without its tool: stop at the first iteration
            if harness_errors:
                raise RuntimeError(f"TRL's python tool failed {len(harness_errors)} times in the benchmark's own "
                                   f"code (not the code it ran), first: {harness_errors[0]}")

        def reward(prompts, completions, answer, **_) -> list[float]:
            harness_ok()
            scores = task.score([Problem(task.name, "", x) for x in answer], [last_turn_text(c) for c in completions])
            rewards_per_call.append(sum(scores) / len(scores))
            if tool_calls is not None:
                tool_calls.append((counts["calls"] - calls_before[0]) / len(completions))
            calls_before[0] = counts["calls"]
            if clock is not None:
                clock.append(time.time())
            return scores

        updates = t.updates_per_iteration
        spec = t.loss_spec()
        warmup = t.lr_schedule.warmup_iterations * updates
        schedule = {"constant": "constant_with_warmup" if warmup else "constant", "linear": "linear",
                    "cosine": "cosine"}[t.lr_schedule.decay]
        args = GRPOConfig(
            output_dir=str(work / f"trl_{seed}"), seed=seed, use_cpu=True, bf16=False, report_to=[],
            save_strategy="no", logging_steps=updates, disable_tqdm=True,
            max_steps=tc.iterations * updates, learning_rate=t.lr, lr_scheduler_type=schedule, warmup_steps=warmup,
            weight_decay=t.weight_decay, max_grad_norm=t.grad_clip,
            per_device_train_batch_size=r.prompts_per_iteration * r.n_samples // updates,
            steps_per_generation=updates, num_generations=r.n_samples, shuffle_dataset=False,
            max_completion_length=a.max_total_tokens, max_tool_calling_iterations=a.max_turns - 1,
            generation_kwargs={"max_new_tokens": a.max_tokens_per_turn or r.max_new_tokens},
            temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            loss_type="grpo", scale_rewards="group" if spec.adv_std_norm else "none", beta=0.0,
            epsilon=spec.clip_eps_low, epsilon_high=spec.clip_eps_high,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, tools=[python])
        if trainer.chat_template is not None:  # TRL swaps in its own template when ours is not prefix-preserving
            raise RuntimeError("TRL replaced the chat template: the sequences would no longer be tide's")
        check_prompt_ids(trainer, agent, problems, tc.model.system_prompt)
        if clock is not None:
            clock.append(time.time())
        trainer.train()
        harness_ok()
        print(f"python tool calls run in the sandbox: {counts['calls']} ({counts['failed']} failed)", flush=True)
        return rewards_per_call
    finally:
        if agent is not None:
            agent.close()
        if sandbox is not None:
            sandbox.stop()


def warm_started_model(cfg: dict, out: Path) -> Path:
    """The job's model after its supervised warm start (the same sequences and steps as run_trl_tools's), saved
    with its tokenizer as a Hugging Face directory: a start both sides load (`model.path`), so that a comparison
    of the two RL loops starts from the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchestrator.agents.agent_rollout import Agent
    from orchestrator.config.schema import parse_config
    from orchestrator.config.model_source import resolve_model_dir
    from orchestrator.workers.prompts import PromptRenderer
    from orchestrator.iteration.session import _model_context
    from rollout.tasks import make_task

    tc = parse_config(cfg, "warm_started_model", ROOT / "configs")
    task = make_task(tc.task)
    model_dir = resolve_model_dir(tc.model.path, tc.model.tiny, task, tc.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    renderer = PromptRenderer(tokenizer, tc.model.chat_template, tc.model.system_prompt)
    agent = Agent(tc.agent, AutoTokenizer.from_pretrained(model_dir), renderer.template, tc.model.system_prompt,
                  tc.rollout.max_new_tokens, "http://unused", tc.task.name, _model_context(model_dir, tc),
                  tc.deterministic)  # lays out demonstrations only: no tool is called
    torch.manual_seed(tc.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    try:
        warm_start(model, tc, task, renderer, agent)
    finally:
        agent.close()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def trl_tools_worker(job: Path, out: Path) -> None:
    """The TRL side as its users run it, in a process of its own: imports TRL, trains, exits. Writes the rewards
    and the clock (time.time() at the start of training and as each iteration is scored) to `out`."""
    cfg = json.loads(job.read_text())
    clock: list[float] = []
    calls: list[float] = []
    rewards = run_trl_tools(cfg, job.parent / f"trl_{cfg['name']}", clock, tool_calls=calls)
    out.write_text(json.dumps({"rewards": rewards, "clock": clock, "tool_calls": calls}))


def check_prompt_ids(trainer, agent, problems: list, system_prompt: str | None) -> None:
    """Every prompt's token ids as TRL renders them (its messages and tools) must be those tide's agent starts the
    trajectory from (rollout/agent/runner.py)."""
    from orchestrator.workers.prompts import with_system_prompt
    from rollout.agent.trajectory import render

    conversations = [with_system_prompt(p.messages, system_prompt) for p in problems]
    trl = trainer._tokenize_prompts(conversations)[0]  # what GRPOTrainer generates from
    for messages, ids in zip(conversations, trl, strict=True):
        tide = render(agent.tokenizer, messages, agent.schemas, True)
        if list(ids) != tide:
            raise RuntimeError(f"TRL's prompt token ids differ from tide's:\n  tide {tide}\n  trl  {list(ids)}")
    print(f"prompt token ids identical on both sides for all {len(problems)} prompts (the first: "
          f"{agent.tokenizer.decode(render(agent.tokenizer, conversations[0], agent.schemas, True))!r})", flush=True)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        trl_tools_worker(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=TOOL_CALC)
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--warmup-steps", type=int, default=None, help="trainer.warmup_sft_steps")
    ap.add_argument("--warmup-lr", type=float, default=None, help="trainer.warmup_sft_lr")
    ap.add_argument("--work", type=Path, default=None, help="where TRL and the sandbox write (default: a temp dir)")
    args = ap.parse_args()
    cfg = yaml.safe_load(args.config.read_text())
    if args.iterations is not None:
        cfg["iterations"] = args.iterations
    if args.seed is not None:
        cfg["seed"] = args.seed
    if args.warmup_steps is not None:
        cfg["trainer"]["warmup_sft_steps"] = args.warmup_steps
    if args.warmup_lr is not None:
        cfg["trainer"]["warmup_sft_lr"] = args.warmup_lr

    clock: list[float] = []
    calls: list[float] = []
    with tempfile.TemporaryDirectory(prefix="tide-trl-tools-") as tmp:
        rewards = run_trl_tools(cfg, args.work or Path(tmp), clock, tool_calls=calls)
    if len(rewards) != cfg["iterations"] or len(clock) != cfg["iterations"] + 1:
        raise RuntimeError(f"{len(rewards)} rewards and {len(clock)} clock readings for {cfg['iterations']} iterations")
    seconds = [b - a for a, b in itertools.pairwise(clock)]
    for it, (reward, per_traj, s) in enumerate(zip(rewards, calls, seconds), 1):
        print(f"iter {it:3d}  reward {reward:.3f}  tool calls/trajectory {per_traj:.2f}  {s:.1f} s")
    print(f"rewards: {[round(x, 4) for x in rewards]}")
    print(f"seconds per iteration: {[round(x, 1) for x in seconds]}")


if __name__ == "__main__":
    main()
