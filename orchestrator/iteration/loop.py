"""One RL iteration after another: rollout -> reward -> [old / reference log-probs] -> train -> publish -> sync
(-> probe) (-> eval) (-> checkpoint).

When each batch is drawn, and by which policy, is the schedule's business (orchestrator/iteration/schedule.py):
lockstep is max_staleness 0; with 1 the next iteration's batch is drawn while this one trains, and with 2 or more
partial rollouts carry generations over. The loop hands it the same calls either way and the schedule answers
them (see docs/design.md, "One loop, one schedule"). The checks of a batch are one step (checks.py)."""
from __future__ import annotations

from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from orchestrator.iteration.checkpointing import save_checkpoint
from orchestrator.iteration.checks import BatchChecks
from orchestrator.iteration.drawing import draw, sampling_seed
from orchestrator.iteration.evaluation import EVAL_STREAM, evaluate, held_out_problems
from orchestrator.iteration.learning_signal import SignalWatch
from orchestrator.iteration.logprob_check import probe_due
from orchestrator.iteration.sample_metrics import sample_metrics, sample_records
from orchestrator.iteration.schedule import Around, RolloutScheduler
from orchestrator.iteration.session import Session, console
from orchestrator.iteration.steps import score, train, train_batch, watch_signal

# What an iteration's train phase reports (trainer/megatron/train_step.py): kl_ref(_mean) with trainer.kl only,
# the clip fractions with loss grpo only, the packed rows with trainer.packing only, the routing figures for
# mixture-of-experts models whose samples carry the rollout's routing (with trainer.moe.routing_replay, over the
# whole batch, with logprob_gap_replayed and logprob_gap_unreplayed)
TRAIN_METRICS = ("loss", "grad_norm", "sq_log_ratio", "kl_ref", "kl_ref_mean", "logp_mean", "entropy",
                 "clip_fraction_low", "clip_fraction_high", "tokens", "optimizer_steps", "routing_mismatch",
                 "routing_mismatch_trained", "routed_tokens", "replay_sequences_affected", "replay_sequences_closer",
                 "replay_sequences_farther", "is_weight_mean", "is_truncated_frac", "skipped_minibatches",
                 "packed_rows", "packed_sequences_per_row")


def run_iterations(s: Session) -> None:
    cfg, run = s.cfg, s.run
    checks, signal = BatchChecks(s), SignalWatch(cfg.logging.no_signal_after)
    devices = s.devices  # trainer and engines taking turns on shared devices (off unless colocated on CUDA)
    schedule = make_schedule(s, checks)
    held_out = held_out_problems(s.task, cfg.seed, cfg.eval.prompts) if cfg.eval.every else []
    manifest = None
    with ProgressBar(cfg, s.start_iteration) as show, schedule:
        for it in range(s.start_iteration + 1, cfg.iterations + 1):
            devices.to_engines(it)  # the first iteration's: later ones hand over after their publish
            with run.phase(it, "rollout") as rec, show("rollout"):
                drawn = schedule.take(it)  # drawn now, or (max_staleness >= 1) while the last iteration trained
                rec["parts"] = drawn.rolled.parts
            schedule.begin(it, drawn)  # the next batch is drawn ahead while this one trains
            with run.phase(it, "reward") as rec:
                scored = score(s, it, drawn)
                rec["parts"] = scored.parts or None  # served models' seconds
            watch_signal(s, signal, it, drawn, scored)
            devices.to_trainer(it)
            batch, mismatch = train_batch(s, it, drawn)  # [old_logprobs] [reference]
            with run.phase(it, "train"), show("train"):
                schedule.training()
                trained = train(s, it, batch)
            gaps = checks.trained(it, drawn, batch, trained, mismatch)
            with run.phase(it, "publish") as rec:
                manifest = s.publish(it)
                rec["bytes"] = manifest.nbytes
            schedule.published(it)  # the batch drawn ahead ends on the weights it began on
            devices.to_engines(it)
            with run.phase(it, "sync") as rec, show(f"sync ({cfg.rollout.sync_mode})"):
                delivery, rec["parts"] = s.sync(manifest)
                rec["bytes"] = manifest.nbytes
            schedule.synced(it)
            with devices.beside_engines(it, needed=probe_due(cfg.rollout.probe_interval, it)):
                probe = checks.probe(it)
            evaluation = {}
            if cfg.eval.every and it % cfg.eval.every == 0:
                with run.phase(it, "eval"), show("eval"):
                    evaluation = evaluate(s.rollout, s.task, held_out, cfg.eval, cfg.rollout,
                                          sampling_seed(cfg.seed + EVAL_STREAM, it), s.agent)
            moved = {"publish_bytes": manifest.nbytes,  # with trainer.lora sync adapter: the adapter's
                     **({"transfer_bytes": delivery.bytes, "transfer_seconds": delivery.seconds,
                         **s.trainer.published_bytes(manifest)} if cfg.transfer.enabled else {})}
            run.log_metrics({"iteration": it, **scored.metrics, **sample_metrics(drawn.rolled.samples),
                             "lr": trained["lr"], **{k: trained[k] for k in TRAIN_METRICS if k in trained},
                             **mismatch, **gaps, **replay_gaps(trained), **probe, "samples": len(drawn.rolled.samples),
                             **drawn.metrics(), **drawn.rendering.metrics(), **drawn.rolled.metrics, **evaluation,
                             **moved})
            run.log_samples(it, sample_records(it, drawn.problems, drawn.rolled.samples, cfg.logging.samples,
                                               scored.extra_columns))
            console.log(f"iter {it:>3}  reward {scored.metrics['reward_mean']:.3f}  entropy {trained['entropy']:.3f}"
                        f"  loss {trained['loss']:+.4f}  gap {gaps['logprob_gap']:.2e}")
            checks.check_probe(it, probe)
            if checkpoint_due(cfg, it):
                with devices.trainer_turn(it), run.phase(it, "checkpoint"), show("checkpoint"):
                    save_checkpoint(run, s.trainer, it, cfg.keep_checkpoints, also=schedule.save_ahead)
            show.advance()
    devices.to_trainer(cfg.iterations)
    run.write_final(cfg.iterations, s.trainer.parameter_digests())
    # the weights the engines served last, outside shared memory (published again if no iteration ran here)
    s.export_final(manifest, run.path / "hf")


def make_schedule(s: Session, checks: BatchChecks) -> RolloutScheduler:
    """The run's schedule (rollout.max_staleness, weight_update), resuming with the batch the checkpoint drew
    ahead."""
    r = s.cfg.rollout
    in_flight = r.weight_update == "in_flight"
    around = Around(s.run, checks.drawn_ahead, s.trainer.snapshot_behaviour, lambda it: checkpoint_due(s.cfg, it))
    schedule = RolloutScheduler(lambda it, version, carried, opened=None: draw(s, it, version, carried, opened),
                                r.max_staleness, s.start_iteration, s.cfg.iterations, in_flight,
                                s.rollout.release_in_flight if in_flight else None, around)
    schedule.load_ahead(s.run.latest_checkpoint() if s.start_iteration else None)
    return schedule


def checkpoint_due(cfg, iteration: int) -> bool:
    return iteration % cfg.save_every == 0 or iteration == cfg.iterations


def replay_gaps(train: dict) -> dict[str, float]:
    """With routing replay, the whole batch's log-prob gap before any update, routed as the rollout routed it
    and as the trainer's own routers would."""
    return {f"logprob_gap_{how}": train[f"behaviour_gap_{how}"] for how in ("replayed", "unreplayed")
            if f"behaviour_gap_{how}" in train}


class ProgressBar:
    """The console's progress bar: iterations done, and the phase the current one is in."""

    def __init__(self, cfg, done: int) -> None:
        self.name, self.total, self.done = cfg.name, cfg.iterations, done

    def __enter__(self) -> "ProgressBar":
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console).__enter__()
        self.bar = self.progress.add_task(self.name, total=self.total, completed=self.done)
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    @contextmanager
    def __call__(self, phase: str):
        self.progress.update(self.bar, description=f"{self.name} · {phase}")
        yield

    def advance(self) -> None:
        self.progress.update(self.bar, advance=1, description=self.name)
