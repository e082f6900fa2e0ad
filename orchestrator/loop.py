"""One RL iteration after another: rollout -> reward -> [old / reference log-probs] -> train -> publish -> sync
(-> eval) (-> checkpoint). With rollout.max_staleness 1 the next iteration's rollout runs from the end of this
one's to its sync, or on through it with the new weights taken in flight (orchestrator/scheduler.py)."""
from __future__ import annotations

import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ckpt_transfer.export import export_hf
from orchestrator.agent_partial import draw_agent_partially
from orchestrator.agent_rollout import Rollout, engine_turns, episode_rewards
from orchestrator.batches import attach_reference_logprobs, samples_batch
from orchestrator.checkpointing import save_checkpoint
from orchestrator.evaluation import EVAL_STREAM, evaluate, held_out_problems
from orchestrator.learning_signal import SignalWatch
from orchestrator.logprob_check import (PROBE_BATCHES, agent_logprob_gap, behaviour_gap, check_logprob_gap,
                                        logprob_gap, probe_due, sampled_gap)
from orchestrator.mismatch import use_trainer_old_logprobs
from orchestrator.partial_rollouts import OpenGroup, PartialDraw, mask_stale, sample_partially, token_staleness
from orchestrator.reward_functions import TrainerState
from orchestrator.rewards import reward_phase
from orchestrator.rundir import PhaseRecord
from orchestrator.sample_metrics import sample_metrics, sample_records
from orchestrator.scheduler import Drawn, RolloutScheduler
from orchestrator.session import Session, console
from rollout.in_flight import InFlight
from rollout.tasks import Problem
from trainer.batch import LoglinearProximal
from trainer.lr_schedule import lr_at


# What an iteration's train phase reports (trainer/megatron/worker.py train_step): kl_ref(_mean) with trainer.kl only,
# the clip fractions with loss grpo only, the routing figures for mixture-of-experts models whose samples carry
# the rollout's routing (with trainer.moe.routing_replay, over the whole batch, with logprob_gap_replayed and
# logprob_gap_unreplayed)
TRAIN_METRICS = ("loss", "grad_norm", "sq_log_ratio", "kl_ref", "kl_ref_mean", "logp_mean", "entropy",
                 "clip_fraction_low", "clip_fraction_high", "tokens", "optimizer_steps", "routing_mismatch",
                 "routing_mismatch_trained", "routed_tokens", "replay_sequences_affected", "replay_sequences_closer",
                 "replay_sequences_farther", "is_weight_mean", "is_truncated_frac", "skipped_minibatches")


def replay_gaps(train: dict) -> dict[str, float]:
    """With routing replay, the whole batch's log-prob gap before any update, routed as the rollout routed it
    and as the trainer's own routers would."""
    return {f"logprob_gap_{how}": train[f"behaviour_gap_{how}"] for how in ("replayed", "unreplayed")
            if f"behaviour_gap_{how}" in train}


def staleness_metrics(drawn: Drawn, masked: int) -> dict[str, float]:
    """The batch's staleness (policy versions between its last sampler and its trainer) and that sampler; with
    partial rollouts or weights taken in flight per token and per sample, and the tokens left out beyond the
    bound (none by schedule)."""
    out = {"staleness": drawn.staleness(), "behaviour_version": drawn.version}
    if "partial_continued" in drawn.rolled.metrics or drawn.in_flight:  # tokens of several versions
        return out | token_staleness(drawn.rolled.samples, drawn.iteration - 1, drawn.version) | {
            "stale_masked_tokens": masked}
    return out | ({"stale_masked_tokens": masked} if masked else {})


def gap_metrics(drawn: Drawn, gap: float) -> dict[str, float]:
    """`logprob_gap`: the batch against the policy that sampled it; a stale batch's `gap` (pi_old, or the
    trainer's current policy, against its sampler) spans an update: `stale_logprob_gap`."""
    if drawn.staleness() == 0:
        return {"logprob_gap": gap}
    newer = {} if drawn.in_flight_logprob_gap is None else {"in_flight_logprob_gap": drawn.in_flight_logprob_gap}
    return {"logprob_gap": drawn.logprob_gap, "stale_logprob_gap": gap} | newer


def checkpoint_due(cfg, iteration: int) -> bool:
    return iteration % cfg.save_every == 0 or iteration == cfg.iterations


def check_behaviour(s: Session, run, drawn: Drawn, iteration: int, bound: float, origin: str) -> None:
    """A batch drawn ahead, against the policy that sampled it: the trainer's snapshot of that policy (taken in
    the train step that came after it was started) scores a share of it (logprob_check.behaviour_gap). Done at
    the start of the iteration that trains it, while the engines draw the next batch, so that the engines do not
    wait for it; or, where a checkpoint is saved before then, before the checkpoint (the snapshot is not in it),
    so that a resumed run finds the batch checked."""
    share = s.cfg.trainer.updates_per_iteration
    with run.phase(iteration, "ahead_check"):
        drawn.logprob_gap = behaviour_gap(s.trainer, drawn.sampled(), s.sampling, share)
        # the tokens sampled after weights taken in flight: by the policy the trainer holds now
        if drawn.in_flight and (newer := drawn.sampled(drawn.version + 1)):
            drawn.in_flight_logprob_gap = sampled_gap(s.trainer, newer[::share], s.sampling)
    check_logprob_gap(drawn.iteration, drawn.logprob_gap, bound, "the batch drawn ahead, against the policy that "
                      "sampled it", origin)
    if drawn.in_flight_logprob_gap is not None:
        check_logprob_gap(drawn.iteration, drawn.in_flight_logprob_gap, bound, "the batch drawn ahead, its tokens "
                          "sampled after the weights taken in flight, against that policy", origin)


def drain_ahead(s: Session, run, scheduler: RolloutScheduler, iteration: int, bound: float, origin: str) -> None:
    """Finish the batch drawn ahead: before the engines' weights change, or (weights taken in flight) before a
    checkpoint saves it; checked now when a checkpoint is due (the snapshot it is checked on is not saved)."""
    with run.phase(iteration, "drain"):
        ahead = scheduler.drain()
    if ahead is not None and checkpoint_due(s.cfg, iteration):
        check_behaviour(s, run, ahead, iteration, bound, origin)


def sampling_seed(seed: int, iteration: int) -> int:
    return (seed * 1_000_003 + iteration * 7919) % (2**31 - 1)


def rollout(s: Session, problems: list[Problem], seed: int, version: int, in_flight: InFlight | None = None,
            opened=None) -> Rollout:
    """The iteration's samples: one completion per sample (`in_flight`: taking the next weights when published,
    rollout/in_flight.py), or with `agent:` multi-turn trajectories (whose tokens carry `version`, the policy the
    engines serve) with the agent's metrics."""
    r = s.cfg.rollout
    if s.agent is None:
        return Rollout(s.rollout.generate(problems, r.n_samples, r.max_new_tokens, s.sampling, seed, in_flight,
                                          opened))
    return s.agent.rollout(engine_turns(s.rollout, s.sampling), problems, r.n_samples, seed, version)


def partial_rollout(s: Session, problems: list[Problem], carried: list[OpenGroup], seed: int, version: int,
                    last: bool) -> PartialDraw:
    """rollout.partial_rollout: the groups `carried` over continued and the new ones opened, a segment each
    (multi-turn trajectories: orchestrator/agent_partial.py); the batch is the groups ended now, at least enough to
    give every mini-batch of every data-parallel replica a sample."""
    r, t, p = s.cfg.rollout, s.cfg.trainer, s.cfg.trainer.parallel
    min_groups = -(-t.updates_per_iteration * p.dp * p.ep // r.n_samples)
    if s.agent is not None:
        return draw_agent_partially(
            s.agent, engine_turns(s.rollout, s.sampling), problems, carried, n_samples=r.n_samples, seed=seed,
            version=version, segment=r.segment_within(s.cfg.agent.max_total_tokens),
            max_draws=r.max_staleness, min_groups=min_groups, finish_all=last)
    return sample_partially(
        lambda requests: s.rollout.generate(requests, 1, r.max_new_tokens, s.sampling, seed), problems, carried,
        n_samples=r.n_samples, max_new_tokens=r.max_new_tokens, segment_tokens=r.segment_tokens,
        max_draws=r.max_staleness, min_groups=min_groups, seed=seed, version=version, finish_all=last,
        decode=lambda ids: s.task.renderer.tokenizer.decode(ids, skip_special_tokens=True))


def draw(s: Session, iteration: int, version: int, carried: list[OpenGroup], opened=None) -> Drawn:
    """Iteration `iteration`'s batch, sampled by the engines, which serve policy `version`; with partial rollouts,
    the groups ended now of those `carried` over and of the new ones, the others set aside. `opened` (a batch
    drawn ahead with weights taken in flight): set once the engines will hand the next sync to this draw."""
    r = s.cfg.rollout
    problems, rendering = s.task.rendered_problems(s.cfg.seed, iteration, r.prompts_per_iteration)
    if not problems:
        raise RuntimeError(f"iteration {iteration}: all {r.prompts_per_iteration} prompts are longer than "
                           f"rollout.max_prompt_tokens = {r.max_prompt_tokens} and were skipped")
    started, t0, seed = time.time(), time.perf_counter(), sampling_seed(s.cfg.seed, iteration)
    if not r.partial_rollout:
        # in flight, the engines may wait for the weights through every trainer call before the publish (ahead
        # check, pi_old, reference, train, publish), each within the trainer's timeout
        switch = None if opened is None else InFlight(version, version + 1, r.in_flight_step, 5 * s.trainer.timeout)
        rolled = rollout(s, problems, seed, version, switch, opened)
        return Drawn(iteration, problems, rendering, rolled, version, started, time.perf_counter() - t0,
                     in_flight=switch is not None)
    part = partial_rollout(s, problems, carried, seed, version, last=iteration == s.cfg.iterations)
    return Drawn(iteration, part.problems, rendering, Rollout(part.samples, part.metrics, part.parts), version,
                 started, time.perf_counter() - t0, set_aside=part.set_aside)


def run_iterations(s: Session) -> None:
    cfg, run, r, t = s.cfg, s.run, s.cfg.rollout, s.cfg.trainer
    in_flight = r.weight_update == "in_flight"
    scheduler = RolloutScheduler(lambda it, version, carried, opened=None: draw(s, it, version, carried, opened),
                                 r.max_staleness, s.start_iteration, cfg.iterations, in_flight,
                                 s.rollout.release_in_flight if in_flight else None)
    scheduler.load_ahead(run.latest_checkpoint() if s.start_iteration else None)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress, scheduler:
        bar = progress.add_task(cfg.name, total=cfg.iterations, completed=s.start_iteration)
        manifest = None
        held_out = held_out_problems(s.task, cfg.seed, cfg.eval.prompts) if cfg.eval.every else []
        gap_bound, bound_origin = r.logprob_gap_bound(cfg.model.dtype), r.logprob_gap_origin(cfg.model.dtype)
        signal = SignalWatch(cfg.logging.no_signal_after)
        for it in range(s.start_iteration + 1, cfg.iterations + 1):
            with run.phase(it, "rollout") as rec:
                progress.update(bar, description=f"{cfg.name} · rollout")
                drawn = scheduler.take(it)  # drawn now, or (max_staleness 1) while the last iteration trained
                problems, rendering, rolled = drawn.problems, drawn.rendering, drawn.rolled
                samples, rec["parts"] = rolled.samples, rolled.parts
            if drawn.staleness():  # its sampling, timed while the last iteration trained
                run.record_phase(PhaseRecord(it, "rollout_ahead", drawn.started, drawn.seconds, parts=rolled.parts))
            scheduler.ahead(it)  # max_staleness 1: the next batch is sampled while this one trains
            if drawn.staleness() and drawn.logprob_gap is None:  # checked while the engines draw the next one
                check_behaviour(s, run, drawn, it, gap_bound, bound_origin)
            with run.phase(it, "reward"):
                steps = t.updates_per_iteration * t.epochs  # what TRL's trainer_state counts: optimizer steps
                scored = episode_rewards(samples) if s.agent and s.agent.scores_itself else reward_phase(
                    s.task, problems, samples, t.length_penalty, s.reward_functions,
                    trainer_state=TrainerState((it - 1) * steps, cfg.iterations * steps))
                reward = scored.metrics
            if signal.observe(it, problems, samples, scored.values):  # no reward spread for a while, or again one
                run.set_status(warning=signal.warning)
                console.log(f"[yellow]{signal.warning or f'iteration {it}: the rewards spread again'}")
            masked = mask_stale(samples, it - 1, r.max_staleness, drawn.version)  # none by schedule: a guard
            loglinear = s.mismatch_correction and r.proximal == "loglinear"  # pi_old interpolated in the train step
            batch, mismatch = samples_batch(samples, s.sampling, version=drawn.version if loglinear else None), {}
            if loglinear:
                batch.proximal = LoglinearProximal(trained_by=it - 1, tis_cap=r.tis_cap)
            elif s.mismatch_correction:
                with run.phase(it, "old_logprobs"):
                    mismatch = use_trainer_old_logprobs(batch, s.trainer.logprobs(batch), s.mismatch_correction)
            if t.kl.coef > 0:
                with run.phase(it, "reference"):
                    attach_reference_logprobs(batch, s.trainer.logprobs(batch, reference=True))
            with run.phase(it, "train"):
                progress.update(bar, description=f"{cfg.name} · train")
                lr = lr_at(t.lr, t.lr_schedule, it, cfg.iterations)
                shuffle = sampling_seed(cfg.seed, it) if t.shuffle_minibatches else None
                if scheduler.drawing:  # by the policy this step updates: kept to check that batch against
                    s.trainer.snapshot_behaviour()
                train = s.trainer.train_step(batch, lr=lr, updates=t.updates_per_iteration, shuffle_seed=shuffle,
                                             epochs=t.epochs)
            # with a mismatch correction, the whole batch's gap, the tokens it leaves out of the loss included; a
            # stale batch's spans an update (its sampler, checked before, is drawn.logprob_gap)
            gap = mismatch.pop("logprob_gap", train["behaviour_gap"])
            if all(x.reward is None for x in samples):  # no token to measure a gap on: not a mismatch
                console.log(f"[yellow]iteration {it}: the rewards left every sample out (None): nothing trained")
            elif drawn.staleness() == 0:
                check_logprob_gap(it, gap, gap_bound, "the whole batch, before any update" if batch.old_recomputed
                                  else "the first mini-batch, before its update", bound_origin)
            gaps = gap_metrics(drawn, gap)
            with run.phase(it, "publish") as rec:
                manifest = s.publish(it)
                rec["bytes"] = manifest.nbytes
            if scheduler.max_staleness and not in_flight:  # the batch drawn ahead ends on the weights it began on
                drain_ahead(s, run, scheduler, it, gap_bound, bound_origin)
            with run.phase(it, "sync") as rec:
                progress.update(bar, description=f"{cfg.name} · sync ({r.sync_mode})")
                delivery, rec["parts"] = s.sync(manifest)  # in flight: taken by the batch being drawn ahead
                rec["bytes"] = manifest.nbytes
            scheduler.synced(it)
            if in_flight and checkpoint_due(cfg, it):  # the checkpoint saves the batch drawn ahead: finished first
                drain_ahead(s, run, scheduler, it, gap_bound, bound_origin)
            probe = {}
            if probe_due(r.probe_interval, it):
                with run.phase(it, "probe"):
                    probe["probe_gap"] = logprob_gap(s.trainer, s.rollout, s.probe, r.max_new_tokens, s.sampling,
                                                     cfg.seed)
                    if s.agent:
                        probe["probe_gap_agent"] = agent_logprob_gap(s.trainer, s.agent, s.rollout, s.agent_probe,
                                                                     s.sampling, cfg.seed)
            evaluation = {}
            if cfg.eval.every and it % cfg.eval.every == 0:
                with run.phase(it, "eval"):
                    progress.update(bar, description=f"{cfg.name} · eval")
                    evaluation = evaluate(s.rollout, s.task, held_out, cfg.eval, r,
                                          sampling_seed(cfg.seed + EVAL_STREAM, it), s.agent)
            moved = ({"transfer_bytes": delivery.bytes, "transfer_seconds": delivery.seconds}
                     if cfg.transfer.enabled else {})
            run.log_metrics({"iteration": it, **reward, **sample_metrics(samples), "lr": train["lr"],
                             **{k: train[k] for k in TRAIN_METRICS if k in train}, **mismatch,
                             **gaps, **replay_gaps(train), **probe, "samples": len(samples),
                             **staleness_metrics(drawn, masked),
                             **rendering.metrics(), **rolled.metrics, **evaluation, **moved})
            run.log_samples(it, sample_records(it, problems, samples, cfg.logging.samples, scored.extra_columns))
            console.log(f"iter {it:>3}  reward {reward['reward_mean']:.3f}  entropy {train['entropy']:.3f}  "
                        f"loss {train['loss']:+.4f}  gap {gaps['logprob_gap']:.2e}")
            for name, probe_gap in probe.items():
                check_logprob_gap(it, probe_gap, gap_bound, PROBE_BATCHES[name], bound_origin)
            if checkpoint_due(cfg, it):
                with run.phase(it, "checkpoint"):
                    progress.update(bar, description=f"{cfg.name} · checkpoint")
                    save_checkpoint(run, s.trainer, it, cfg.keep_checkpoints, also=scheduler.save_ahead)
            progress.update(bar, advance=1, description=cfg.name)
    run.write_final(cfg.iterations, s.trainer.parameter_digests())
    # the weights the engines served last, outside shared memory (published again if no iteration ran here)
    export_hf(manifest or s.publish(cfg.iterations), run.path / "hf")
