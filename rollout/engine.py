"""The rollout engine: one vLLM `LLM` whose V1 EngineCore runs in this process (`engine_process: inline`) or
in a child process (`separate`); "the engine process" is whichever process runs the engine core.

`RolloutEngine` is a plain class; the orchestrator runs it as a Ray actor (`ray.remote(num_cpus=0)`). It
generates samples with the log-probs of the sampled tokens, scores given sequences teacher-forced, swaps
weights (`sync`: restart or in-place reload of a verified published iteration, or a LoRA adapter served on the
base model, rollout/lora_serving.py) and, with a separate engine
process, restarts it on the latest verified weights when it dies (an inline engine dies with its actor: the
rollout group replaces the actor). vLLM is imported lazily so that importing this module (e.g. for
`EngineConfig`) stays cheap.

This module is the engine's door. Below it: the vLLM `LLM` with its processes and thread (vllm_engine.py), its
environment and arguments (engine_setup.py, engine_model.py), the requests of a call and their answers
(engine_requests.py), weights taken while a call runs (in_flight.py) and the processes' bookkeeping
(engine_proc.py).
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Literal, Sequence, TypeVar

from ckpt_transfer.manifest import Manifest
from ckpt_transfer.verify import (
    CheckpointError,
    engine_checkpoint_dir,
    layout_difference,
    tensor_layout,
    verify_manifest,
)

from . import routing_capture
from .config import EngineConfig
from .engine_errors import EngineError, SyncError
from .engine_model import routing_capture_setup
from .engine_requests import (completion_logprobs, generate_requests, prompt_seed, samples_from_outputs,
                              score_requests)
from .engine_setup import configure_env, llm_kwargs
from .in_flight import InFlight, Offered, WeightSlot, generate_in_flight
from .lora_serving import Adapter, AdapterServing
from .samples import Samples
from .tasks.base import Problem
from .vllm_engine import VllmEngine

__all__ = ["RolloutEngine", "EngineConfig", "EngineError", "SyncError", "SyncMode", "configure_env",
           "generate_requests", "llm_kwargs", "prompt_seed", "routing_capture_setup"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")
SyncMode = Literal["restart", "reload", "adapter"]


class RolloutEngine:
    def __init__(self, model_dir: str, cfg: EngineConfig | None = None, *, dtype: str = "float32", seed: int = 0,
                 deterministic: bool = False, start_on: Manifest | None = None) -> None:
        """`dtype`: float32 by default (bf16 is slower on CPU and drifts from a float32 trainer);
        `deterministic` turns prefix caching off, so every prompt is recomputed on the same path. `start_on`:
        a published iteration to start on instead of `model_dir`, verified as a sync verifies it (the rollout
        group replacing an engine that died); a LoRA adapter's is served on `model_dir` (cfg.lora)."""
        self.cfg = cfg or EngineConfig()
        self.dtype, self.seed, self.deterministic = dtype, seed, deterministic
        self._checkpoint_dir = Path(model_dir)  # latest verified weights: restarts always go back here
        self._iteration: int | None = None
        self._deaths = 0
        self._closed = False
        self._parked = False  # stopped on purpose (park) until its next call
        self._scratch: Path | None = None  # a merged-TP directory we wrote for the current weights
        self._layout: dict = {}  # tensor names/dtypes/shapes of the weights being served
        self._slot: WeightSlot | None = None  # while a generate takes weights in flight (rollout/in_flight.py)
        # generate/score/sync/shutdown take turns (the actor may run with max_concurrency > 1 so that
        # engine_pid/info answer while a generate runs).
        self._lock = threading.RLock()
        self._lora = None if self.cfg.lora is None else AdapterServing(  # the adapter served on the base (cfg.lora)
            self.cfg.lora, self.cfg.device, self._checkpoint_dir, Path(tempfile.gettempdir()) / "tide-rollout")
        self._vllm = VllmEngine(self.cfg, dtype, seed, deterministic)
        adapter, start_on = (start_on, None) if start_on is not None and start_on.is_adapter else (None, start_on)
        if adapter is not None and self._lora is None:
            raise EngineError(f"cannot start on {adapter.run} iteration {adapter.iteration}: a LoRA adapter, and "
                              f"this engine serves none (cfg.lora)")
        if start_on is not None:
            try:
                path, self._layout, _ = self._verified(start_on)
            except CheckpointError as e:
                raise EngineError(f"cannot start on {start_on.run} iteration {start_on.iteration}: {e}") from None
            self._checkpoint_dir, self._iteration = path, start_on.iteration
            self._scratch = path if path != Path(start_on.directory) else None
        elif not (self._checkpoint_dir / "config.json").is_file():
            raise EngineError(f"{self._checkpoint_dir} is not a Hugging Face model directory (no config.json)")
        else:
            self._layout = tensor_layout(self._checkpoint_dir)
        self._start(self._checkpoint_dir)
        atexit.register(self.shutdown)
        if adapter is not None:
            try:
                self._sync_adapter(adapter)
            except SyncError as e:
                self.shutdown()
                raise EngineError(f"cannot start on {adapter.run} iteration {adapter.iteration}: {e}") from None

    # ------------------------------------------------------------------ public API

    def generate(
        self, problems: list[Problem], n_samples: int, max_new_tokens: int, temperature: float, seed: int,
        top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
        in_flight: InFlight | None = None,
    ) -> Samples:
        """`n_samples` completions per problem, sampled from softmax(logits / temperature) truncated to the
        top_k tokens (0: all) and the top_p nucleus (1.0: all), with every sampled token's log-prob under that
        same distribution (vLLM's processed log-probs; with temperature 1 and no truncation, the raw ones).
        A problem's `prompt_ids` are used as they are (else vLLM tokenises `prompt`). Generation ends at the
        end-of-sequence token, a token of `stop_token_ids` or a string of `stop`; the completion's tokens keep
        what ended it (the policy sampled it), its text stops before a stop string.
        Sample.prompt_index = problem index. `in_flight`: a `sync` to its version made while this call runs is
        loaded between two decode steps (rollout/in_flight.py); each sample then carries its tokens' versions."""
        if n_samples < 1 or max_new_tokens < 1:
            raise ValueError("n_samples and max_new_tokens must be >= 1")
        if in_flight is not None and self._lora is not None:
            raise EngineError("in-flight weight updates are not built for LoRA adapters (vLLM fixes a request's "
                              "adapter when it starts): use weight_update drain")
        prompts, params = generate_requests(problems, n_samples, max_new_tokens, temperature, seed, top_p, top_k,
                                            stop, stop_token_ids)
        if not prompts:
            return Samples()
        slot = None
        if in_flight is not None:  # opened by open_in_flight, or here
            slot = self._slot if self._slot is not None and self._slot.switch == in_flight else WeightSlot(in_flight)
            self._slot = slot
        try:
            with self._lock:
                first_version = None
                if slot is None:
                    outputs = self._call("generate", lambda llm: llm.generate(prompts, params, use_tqdm=False,
                                                                              lora_request=self._lora_request()))
                else:
                    outputs, first_version = self._call(
                        "generate", lambda llm: self._generate_in_flight(llm, prompts, params, slot))
                routing = routing_capture.request_records(self._vllm.routing_records(), n_samples)
        finally:
            if slot is not None:
                slot.close()
                if self._slot is slot:
                    self._slot = None
        return samples_from_outputs(outputs, problems, n_samples, self._vllm.llm.get_tokenizer(), routing,
                                    self._vllm.routing_shape is not None, first_version)

    def score_sequences(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        """Teacher-forced raw log-prob of each completion token given its prompt and the tokens before it."""
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        todo = [k for k, c in enumerate(completion_ids) if c]
        result: list[list[float]] = [[] for _ in prompt_ids]
        if not todo:
            return result
        prompts, params = score_requests(prompt_ids, completion_ids, todo)
        with self._lock:
            outputs = self._call("score_sequences", lambda llm: llm.generate(prompts, params, use_tqdm=False,
                                                                             lora_request=self._lora_request()))
            self._vllm.routing_records()  # not wanted here: dropped
        for k, out in zip(todo, outputs):
            result[k] = completion_logprobs(out, len(prompt_ids[k]), completion_ids[k])
        return result

    def sync(self, manifest: Manifest, mode: SyncMode = "reload", restart_if_layout_differs: bool = False) -> dict:
        """Load a published iteration: `restart` stops the engine process and starts a new one on it,
        `reload` loads the weights into the running engine; `adapter` (an engine started with cfg.lora) serves a
        published LoRA adapter on the base model in place of the previous adapter (the base is never reloaded). The
        files are verified first; on any failure the engine keeps serving the previous verified weights (and
        adapter) and SyncError names the problem. A reload of
        tensors other than the served ones (names, dtypes, shapes) is refused, or, with
        `restart_if_layout_differs` (the first load after starting on a base checkpoint stored otherwise),
        done as a restart."""
        if mode not in ("restart", "reload", "adapter"):
            raise ValueError(f"sync mode must be 'restart', 'reload' or 'adapter', got {mode!r}")
        if mode == "adapter" and self._lora is None:
            raise ValueError("sync mode 'adapter' needs an engine started with cfg.lora (trainer.lora.sync adapter)")
        # A generate that takes these weights in flight is open (open_in_flight) or running: handed to it (the
        # first check); or it opens while this sync waits for the engine (the checks while waiting)
        offered = False
        while True:
            slot = self._slot
            if not offered and slot is not None and mode == "reload" and manifest.iteration == slot.switch.to_version:
                offered = True
                if (taken := self._offer(slot, manifest)) is not None:
                    return taken
            if self._lock.acquire(timeout=0.05):
                break
        try:
            return self._sync_locked(manifest, mode, restart_if_layout_differs)
        finally:
            self._lock.release()

    def _sync_locked(self, manifest: Manifest, mode: SyncMode, restart_if_layout_differs: bool) -> dict:
        if self._closed:
            raise EngineError("engine was shut down")
        if mode == "adapter":
            return self._sync_adapter(manifest)
        t0 = time.monotonic()
        try:
            if manifest.is_adapter:
                raise CheckpointError(f"{manifest.directory} holds a LoRA adapter: sync it with mode 'adapter'")
            path, layout, nbytes = self._verified(manifest)
            # In-place loading needs the same tensors; a failed reload_weights also breaks vLLM's later
            # reloads, so catch a mismatch before the engine sees it.
            if mode == "reload" and (why := layout_difference(layout, self._layout)):
                if not restart_if_layout_differs:
                    raise CheckpointError(f"cannot be loaded in place: {why}")
                log.info("%s iteration %d is stored otherwise than the served weights (%s): restarting on it",
                         manifest.run, manifest.iteration, why)
                mode = "restart"
        except CheckpointError as e:
            raise self._refused(manifest, e) from None
        t1 = time.monotonic()
        if mode == "reload":
            self._reload(path, manifest.iteration)
        else:
            self._restart_on(path, manifest.iteration)
        t2 = time.monotonic()
        self._serve(manifest, path, layout)
        if self._lora is not None:  # the model synced is served bare
            self._vllm.on_thread(lambda: self._lora.drop(self._vllm.llm))
        return {"mode": mode, "iteration": manifest.iteration, "bytes": nbytes,
                "verify_s": t1 - t0, "load_s": t2 - t1, "seconds": t2 - t0}

    def _offer(self, slot: WeightSlot, manifest: Manifest) -> dict | None:
        """A sync to the version a running generate takes in flight: verified here (while the engine generates),
        loaded by the engine thread between two decode steps. None: the call did not take it (it ended first, or
        the weights cannot be loaded in place), and the sync loads it as usual once the call is done."""
        t0 = time.monotonic()
        try:
            path, layout, nbytes = self._verified(manifest)
        except CheckpointError as e:
            slot.release()  # nothing will come: the generate goes on without waiting for it
            raise self._refused(manifest, e) from None
        if layout_difference(layout, self._layout):  # a restart, which cannot happen between two steps
            slot.release()
            return None
        t1 = time.monotonic()
        load_s = slot.offer(Offered(manifest.iteration, path, manifest, layout), self.cfg.engine_call_timeout_s)
        if load_s is None:
            return None
        return {"mode": "in_flight", "iteration": manifest.iteration, "bytes": nbytes, "verify_s": t1 - t0,
                "load_s": load_s, "seconds": time.monotonic() - t0}

    def _sync_adapter(self, manifest: Manifest) -> dict:
        """Serve the published adapter of `manifest` on the base model (sync mode `adapter`)."""
        t0 = time.monotonic()
        try:
            adapter = self._lora.prepare(manifest, self._layout)
        except CheckpointError as e:
            raise self._refused(manifest, e) from None
        t1 = time.monotonic()
        try:
            self._call("adapter sync", lambda llm: self._lora.load(llm, adapter))
        except Exception as e:
            self._lora.discard(adapter)
            self._adapter_recover(adapter)
            raise SyncError(f"loading the adapter of {manifest.run} iteration {manifest.iteration} failed "
                            f"({type(e).__name__}: {e}); still serving {self._serving()}") from None
        t2 = time.monotonic()
        self._iteration = manifest.iteration
        return {"mode": "adapter", "iteration": manifest.iteration, "bytes": adapter.nbytes,
                "verify_s": t1 - t0, "load_s": t2 - t1, "seconds": t2 - t0}

    def _adapter_recover(self, failed: Adapter) -> None:
        """After a failed adapter load: an engine whose adapters are not as served is started again (it registers
        the served adapter as it starts)."""
        if self._vllm.alive() and self._vllm.on_thread(lambda: self._lora.intact(self._vllm.llm, failed)):
            return
        log.warning("the engine's adapters are not as served after a failed adapter load: restarting it")
        self._vllm.teardown()
        self._start(self._checkpoint_dir)

    def _lora_request(self) -> Any:
        """The LoRARequest of the served adapter, carried by every request; None: the bare weights."""
        return self._lora.request if self._lora is not None else None

    def _serving(self) -> str:
        return f"{self._checkpoint_dir}{self._lora.describe() if self._lora is not None else ''}"

    def _refused(self, manifest: Manifest, why: CheckpointError) -> SyncError:
        return SyncError(f"refused {manifest.run} iteration {manifest.iteration}: {why}; "
                         f"still serving {self._serving()}")

    def open_in_flight(self, switch: InFlight) -> None:
        """Ready the generate call about to be made with `switch`: a sync to its version made from now on is
        handed to that call (loaded at its step), also if the call has not reached the engine yet."""
        self._slot = WeightSlot(switch)

    def release_in_flight(self) -> None:
        """A generate waiting for in-flight weights goes on without them (the run is stopping)."""
        if (slot := self._slot) is not None:
            slot.release()

    def _serve(self, manifest: Manifest, path: Path, layout: dict) -> None:
        """The engine serves `manifest`'s weights, loaded from `path`: the latest verified ones, to which a
        restart goes back."""
        old_scratch = self._scratch
        self._scratch = path if path != Path(manifest.directory) else None
        self._checkpoint_dir, self._iteration, self._layout = path, manifest.iteration, layout
        if old_scratch is not None and old_scratch != path:
            shutil.rmtree(old_scratch, ignore_errors=True)

    def process(self) -> tuple[str, int]:
        """(Ray node id, pid) of this actor's own process, so that whoever kills the actor can wait for it."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def engine_pid(self) -> int:
        """The process that runs the engine core: this actor's own with an inline engine."""
        if self._vllm.llm is None:
            raise EngineError("engine is not running")
        return self._vllm.pid()

    def info(self) -> dict:
        """State for callers and tests; answers without waiting for a running call (no lock)."""
        llm = self._vllm.llm
        return {
            "checkpoint_dir": str(self._checkpoint_dir),
            "iteration": self._iteration,
            "engine_pid": self._vllm.pid() if llm is not None else None,
            "starts": self._vllm.starts,
            "engine_deaths": self._deaths,
            "last_start_s": self._vllm.last_start_s,
            "block_size": llm.llm_engine.vllm_config.cache_config.block_size if llm is not None else None,
            "max_model_len": llm.llm_engine.vllm_config.model_config.max_model_len if llm is not None else None,
            "unfinished_requests": llm.llm_engine.get_num_unfinished_requests() if llm is not None else 0,
            "adapter": self._lora.info() if self._lora is not None else None,
        }

    def registered_adapters(self) -> list[int]:
        """The ids of the LoRA adapters vLLM holds (the served one alone, after a sync)."""
        with self._lock:
            return sorted(self._call("registered_adapters", lambda llm: llm.llm_engine.list_loras()))

    @property
    def last_start_s(self) -> float:
        """Seconds the latest engine start took."""
        return self._vllm.last_start_s

    def sleep(self, level: int) -> None:
        """vLLM's sleep mode (rollout.sleep_level), while the trainer holds the GPU: the KV cache discarded and the
        weights moved to host memory (level 1) or dropped (level 2: the next sync loads new ones anyway)."""
        with self._lock:
            self._call("sleep", lambda llm: llm.sleep(level=level))

    def park(self) -> None:
        """Stop the engine process, freeing all its memory, while the trainer holds the GPU (rollout.sync_mode
        restart, the Kimi way): the next sync starts it on the new weights, any other call first on the weights it
        served."""
        with self._lock:
            self._vllm.teardown()
            self._parked = True

    def wake_up(self) -> None:
        """The engine's GPU memory back after `sleep` (with level 2, weights to be loaded by the sync that follows)."""
        with self._lock:
            self._call("wake_up", lambda llm: llm.wake_up())

    def shutdown(self, process_ends: bool = False) -> None:
        """Stop the engine process and remove what it left in shared memory. Idempotent. `process_ends`: the
        caller ends this process next (RolloutGroup ends the actor), so an inline engine with no process of its
        own skips vLLM's in-process teardown, whose garbage collections over the whole heap took 2-3 s here."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._vllm.teardown(process_ends)
            self._vllm.close()
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)
            if self._lora is not None:
                self._lora.close()

    # ------------------------------------------------------------------ calls on the engine

    def _call(self, what: str, fn: Callable[[Any], _T]) -> _T:
        """Run fn(llm) on the engine's thread; if the engine process dies (before or during the call), start a new
        one on the latest verified weights and retry, at most cfg.max_engine_restarts times."""
        return self._vllm.on_thread(self._call_on_engine_thread, what, fn)

    def _call_on_engine_thread(self, what: str, fn: Callable[[Any], _T]) -> _T:
        if self._closed:
            raise EngineError("engine was shut down")
        if self._parked:  # stopped on purpose: started again, not counted as a death
            self._parked = False
            self._start(self._checkpoint_dir)
        restarts, last_error = 0, None
        while True:
            if not self._vllm.alive():
                if restarts >= self.cfg.max_engine_restarts:
                    raise EngineError(
                        f"{what}: the vLLM engine process died {restarts + 1} times during one call "
                        f"(max_engine_restarts={self.cfg.max_engine_restarts}); last error: {last_error!r}"
                    )
                restarts += 1
                self._deaths += 1
                log.warning("%s: engine process is dead, restarting on %s (attempt %d)", what,
                            self._checkpoint_dir, restarts)
                self._vllm.teardown()
                self._start(self._checkpoint_dir)
            try:
                return fn(self._vllm.llm)
            except Exception as e:
                if self._vllm.alive():
                    raise
                last_error = e

    def _generate_in_flight(self, llm: Any, prompts: list, params: list, slot: WeightSlot) -> tuple[list, int]:
        """The outputs of a generate that takes `slot`'s weights between two decode steps
        (in_flight.generate_in_flight), and the version that sampled the first tokens."""
        first = self._iteration if self._iteration is not None else slot.switch.from_version
        outputs = self._vllm.on_thread(
            generate_in_flight, llm, prompts, params, slot, first,
            switch_weights=lambda offered: self._switch_weights(llm, slot, offered),
            serving=lambda: self._vllm.llm is llm and self._vllm.alive())
        return outputs, first

    # ------------------------------------------------------------------ the engine's weights

    @staticmethod
    def _verified(manifest: Manifest) -> tuple[Path, dict, int]:
        """The HF directory to load for a published iteration once its files check out, its tensor layout and
        its size in bytes; CheckpointError names what is wrong."""
        nbytes = verify_manifest(manifest)
        path = engine_checkpoint_dir(manifest, f"engine-whole-{os.getpid()}")
        return path, tensor_layout(path), nbytes

    def _reload(self, path: Path, iteration: int) -> None:
        if not self._vllm.alive():
            self._restart_on(path, iteration)
            return
        self._sync_step(f"reload of iteration {iteration} from {path}", lambda: self._vllm.load_in_place(path))

    def _switch_weights(self, llm: Any, slot: WeightSlot, offered: Offered) -> None:
        """Load the offered weights between two steps and recompute the running requests' KV under them (they
        are preempted and prefilled again, their tokens kept); from the next step on, tokens are labelled with
        the new version. A failed load fails the generate as well, after the engine went back to the previous
        weights (a sync's failure: SyncError to the sync's caller)."""
        t0 = time.monotonic()
        try:
            llm.collective_rpc("reload_weights", timeout=self.cfg.engine_start_timeout_s,
                               kwargs={"weights_path": str(offered.path)})
            if not llm.reset_prefix_cache(reset_running_requests=True):
                raise EngineError("reset_prefix_cache refused with the running requests reset")
        except Exception as e:
            error = SyncError(f"in-flight reload of iteration {offered.version} from {offered.path} failed "
                              f"({type(e).__name__}: {e}); still serving {self._checkpoint_dir}")
            slot.loaded(error)
            self._recover()
            raise EngineError(f"generate: {error}") from None
        llm.llm_engine.set_weight_version(str(offered.version))
        self._serve(offered.manifest, offered.path, offered.layout)
        slot.loaded(time.monotonic() - t0)

    def _restart_on(self, path: Path, iteration: int) -> None:
        self._vllm.teardown()
        self._parked = False
        self._sync_step(f"restart on iteration {iteration} from {path}", lambda: self._start(path))

    def _sync_step(self, what: str, step: Callable[[], None]) -> None:
        """Run the loading step of a sync; if it fails, go back to the latest verified weights and raise
        SyncError naming what failed."""
        try:
            step()
        except Exception as e:
            detail = f"{type(e).__name__}: {e}"
            self._recover()
            raise SyncError(f"{what} failed ({detail}); still serving {self._checkpoint_dir}") from None

    def _recover(self) -> None:
        """Back to the latest verified weights after a failed sync (the engine may hold partial weights)."""
        if self._vllm.alive():
            try:
                self._vllm.load_in_place(self._checkpoint_dir)
                if self._lora is not None:  # vLLM drops its adapters when weights are reloaded
                    self._vllm.on_thread(self._lora.restore, self._vllm.llm)
                return
            except Exception as e:
                log.warning("reloading the previous weights failed (%s); restarting the engine", e)
        self._vllm.teardown()
        self._start(self._checkpoint_dir)

    def _start(self, path: Path) -> None:
        """Start an engine on `path`, serving the served adapter (if any) on it."""
        self._vllm.start(path)
        if self._lora is not None:
            self._vllm.on_thread(self._lora.restore, self._vllm.llm)
