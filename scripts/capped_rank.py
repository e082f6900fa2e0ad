"""A one-rank Megatron trainer in a child process whose data segment is capped, for scripts/bench_long.py: each
train step's peak memory (the process's RSS high-water mark, reset before the step) and seconds, and a step that
needs more than its budget fails in the child with an allocation error instead of taking the machine down.

The cap is RLIMIT_DATA (setrlimit(2)), set once the rank is built to its data segment then plus the step budget:
since Linux 4.7 it bounds the private writable mappings, so glibc's malloc and mmap return NULL past it and torch
raises "can't allocate memory" (Python: MemoryError). A child that dies instead (a C++ thread that cannot
allocate) is reported as failed the same way."""
from __future__ import annotations

import ctypes
import gc
import math
import multiprocessing as mp
import resource
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

# Positions of the warm-up step each worker takes after it is built: Adam's moments and Megatron's buffers are
# allocated by the first step, and belong to the baseline, not to the first measured step's peak.
WARMUP_POSITIONS = 128


def proc_status_bytes(key: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM, VmData) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_high_water_mark() -> int:
    """Free what can be freed (gc, glibc's malloc_trim) and reset VmHWM to the current RSS: writing "5" to
    /proc/self/clear_refs (proc(5)). Returns that RSS, the step's baseline."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to trim
        pass
    Path("/proc/self/clear_refs").write_text("5")
    return proc_status_bytes("VmRSS")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def out_of_memory(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, MemoryError) or "can't allocate memory" in text or "out of memory" in text.lower()


def sequence_batch(lengths: list[int], vocab: int, seed: int, prompt: int = 64):
    """One RL batch: a sequence of `n` positions per entry of `lengths` (a prompt of up to `prompt` tokens, the
    rest completion; n + 1 tokens, since position t predicts token t + 1), random tokens from `seed`, behaviour
    log-probs -3, rewards alternating 1, 0 in groups of two."""
    import torch

    from trainer.batch import TrainBatch, TrainSequence

    g = torch.Generator().manual_seed(seed)
    seqs = []
    for k, n in enumerate(lengths):
        ids = torch.randint(1, vocab, (n + 1,), generator=g).tolist()
        p = min(prompt, n // 2)
        seqs.append(TrainSequence(ids[:p], ids[p:], old_logprobs=[-3.0] * (n + 1 - p), reward=float(k % 2 == 0),
                                  group=k // 2))
    return TrainBatch(seqs)


def _serve(conn, hf_dir: str, trainer: dict, budget_bytes: int | None, threads: int, seed: int) -> None:
    """The child: build the rank, take the warm-up step, then answer ("step", lengths, seed) with the step's
    figures until ("close",)."""
    import torch

    torch.set_num_threads(threads)
    try:
        from trainer.config import TrainerConfig, TrainerSpec
        from trainer.megatron.rank import MegatronRank
        from trainer.megatron.train_step import train_step

        t = time.perf_counter()
        rank = MegatronRank(TrainerSpec(hf_dir=hf_dir, trainer=TrainerConfig(**trainer), seed=seed), 0, 1,
                            "127.0.0.1", _free_port())
        vocab = rank.hf_config.vocab_size
        train_step(rank, sequence_batch([WARMUP_POSITIONS] * 2, vocab, seed), lr=1e-5)
        # Capped once built: loading maps the checkpoint file privately once per tensor read (safetensors), which
        # counts against RLIMIT_DATA until those maps are collected, though it touches only the file's pages
        gc.collect()
        data = proc_status_bytes("VmData")
        if budget_bytes:
            resource.setrlimit(resource.RLIMIT_DATA, (data + budget_bytes, data + budget_bytes))
        conn.send({"built_s": time.perf_counter() - t, "rss_bytes": proc_status_bytes("VmRSS"), "data_bytes": data})
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, which counts the side as failed)
        conn.send({"error": f"{type(exc).__name__}: {exc}"[:500], "out_of_memory": out_of_memory(exc)})
        return
    while True:
        msg = conn.recv()
        if msg[0] == "close":
            rank.shutdown()
            conn.send({"closed": True})
            return
        _, lengths, batch_seed = msg
        batch = sequence_batch(lengths, vocab, batch_seed)
        baseline = reset_high_water_mark()
        try:
            t = time.perf_counter()
            out = train_step(rank, batch, lr=1e-5)
            seconds = time.perf_counter() - t
            conn.send({"seconds": seconds, "peak_bytes": proc_status_bytes("VmHWM"), "baseline_bytes": baseline,
                       "loss": out["loss"], "optimizer_steps": out["optimizer_steps"]})
        except BaseException as exc:  # noqa: BLE001
            conn.send({"error": f"{type(exc).__name__}: {exc}"[:500], "out_of_memory": out_of_memory(exc),
                       "traceback": traceback.format_exc(limit=4)[-1500:]})


@dataclass
class StepResult:
    """One step's figures, or why there are none (`error`; `out_of_memory` when an allocation failed or the
    child died)."""

    seconds: float = math.nan
    peak_bytes: float = math.nan
    baseline_bytes: float = math.nan
    loss: float = math.nan
    error: str | None = None
    out_of_memory: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and math.isfinite(self.loss)


@dataclass
class CappedRank:
    """The parent's handle on one worker process: `step(lengths, seed)` runs one RL train step of a batch with
    sequences of those lengths. The worker is started on first use and again after a failed step (its state is
    not trusted after an exception inside Megatron's schedule)."""

    hf_dir: str
    trainer: dict
    budget_bytes: int | None  # what a step may allocate beyond the built rank (None: no cap)
    threads: int = 2
    seed: int = 0
    built: dict = field(default_factory=dict, init=False)
    _proc: object = field(default=None, init=False, repr=False)
    _conn: object = field(default=None, init=False, repr=False)

    def _start(self) -> StepResult | None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self.hf_dir, self.trainer, self.budget_bytes,
                                                      self.threads, self.seed), daemon=True)
        self._proc.start()
        child.close()
        reply = self._receive()
        if "error" in reply:
            self.close()
            return StepResult(error=reply["error"], out_of_memory=reply.get("out_of_memory", False))
        self.built = reply
        return None

    def _receive(self) -> dict:
        try:
            return self._conn.recv()
        except EOFError:  # the child died: aborted on an allocation it could not make (SIGABRT from an uncaught
            # std::bad_alloc), killed (SIGKILL: the kernel's OOM killer), or something else
            self._proc.join()
            code = self._proc.exitcode
            return {"error": f"worker died (exit code {code})", "out_of_memory": code in (-signal.SIGABRT,
                                                                                          -signal.SIGKILL)}

    def step(self, lengths: list[int], seed: int) -> StepResult:
        if self._proc is None:
            failed = self._start()
            if failed:
                return failed
        self._conn.send(("step", lengths, seed))
        reply = self._receive()
        if "error" in reply:
            self.close()
            return StepResult(error=reply["error"], out_of_memory=reply.get("out_of_memory", False))
        return StepResult(seconds=reply["seconds"], peak_bytes=reply["peak_bytes"],
                          baseline_bytes=reply["baseline_bytes"], loss=reply["loss"])

    def close(self) -> None:
        if self._proc is None:
            return
        if self._proc.is_alive():
            try:
                self._conn.send(("close",))
                self._conn.recv()
            except (EOFError, BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()
        self._proc = self._conn = None
