"""The run pool: one worker thread per cgroup slot, each taking jobs from one queue and running them on its seat;
requests are admitted all or none up to the working slots plus the queue (beyond that, Overloaded)."""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Callable

from . import metrics
from .cgroups import Slot
from .config import SandboxConfig
from .containers import Seat
from .errors import BadRequest, Overloaded
from .models import RunRequest, RunResult, Status

log = logging.getLogger("tide.sandbox")

Execute = Callable[[Seat, RunRequest], RunResult]


class Worker(threading.Thread):
    """A slot's thread: runs queued requests one at a time, and takes the slot out of service when a run leaves
    processes that survive SIGKILL."""

    def __init__(self, slot: Slot, netns: str | None, jobs: queue.Queue, execute: Execute,
                 release: Callable[[int], None]):
        super().__init__(name=f"sandbox-slot{slot.index}", daemon=True)
        self.slot, self.netns = slot, netns
        self._jobs, self._execute, self._release = jobs, execute, release
        self.busy = False
        self.broken = False

    def run(self) -> None:
        self.slot.join_current_thread()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            req, fut = job
            if not fut.set_running_or_notify_cancel():
                self._release(1)
                continue
            self.busy = True
            metrics.BUSY.inc()
            try:
                res = self._execute(self, req)
            except BadRequest as exc:
                res = RunResult(status=Status.internal_error, stderr=f"bad request: {exc}")
            except Exception as exc:  # never let one execution take the worker down
                log.exception("execution failed")
                res = RunResult(status=Status.internal_error, stderr=f"{type(exc).__name__}: {exc}")
            finally:
                self.busy = False
                metrics.BUSY.dec()
                self._release(1)
            if not self.slot.drain(timeout_s=5.0):
                log.error("slot %d: processes survive SIGKILL; taking it out of service", self.slot.index)
                self.broken = True
                metrics.BROKEN.inc()
                fut.set_result(res)
                return
            fut.set_result(res)


class RunPool:
    def __init__(self, config: SandboxConfig):
        self.config = config
        self.workers: list[Worker] = []
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._inflight = 0

    def start(self, seats: list[tuple[Slot, str]], execute: Execute) -> None:
        """A worker per (slot, network namespace), started once all exist."""
        for slot, netns in seats:
            self.workers.append(Worker(slot, netns, self._jobs, execute, self._release))
        for w in self.workers:
            w.start()

    def stop(self) -> None:
        for _ in self.workers:
            self._jobs.put(None)
        for w in self.workers:
            w.join(timeout=30)

    def submit_many(self, reqs: list[RunRequest]) -> list[Future]:
        """Queue all or none (raises Overloaded when they do not fit)."""
        if self.capacity == 0:
            raise Overloaded("no working slot")
        if len(reqs) > self.capacity:
            raise BadRequest(f"batch of {len(reqs)} exceeds the capacity of {self.capacity}; split it")
        self._reserve(len(reqs))
        futs: list[Future] = []
        for r in reqs:
            fut: Future = Future()
            self._jobs.put((r, fut))
            futs.append(fut)
        return futs

    def _reserve(self, n: int) -> None:
        with self._lock:
            if self._inflight + n > self.capacity:
                metrics.REJECTED.inc()
                raise Overloaded(f"{self._inflight} executions in flight")
            self._inflight += n
            metrics.QUEUED.set(max(0, self._inflight - len(self.workers)))

    def _release(self, n: int) -> None:
        with self._lock:
            self._inflight -= n
            metrics.QUEUED.set(max(0, self._inflight - len(self.workers)))

    @property
    def capacity(self) -> int:
        """Most executions one request may carry: the working slots plus the queue (0 when none works)."""
        working = sum(not w.broken for w in self.workers)
        return working + self.config.max_queue if working else 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            inflight = self._inflight
        busy = sum(w.busy for w in self.workers)
        return {"slots": len(self.workers), "busy": busy, "queued": max(0, inflight - busy),
                "broken": sum(w.broken for w in self.workers)}
