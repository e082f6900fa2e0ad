"""Prometheus metrics of the sandbox service (one registry per process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry()
RUNS = Counter("tide_sandbox_runs", "Executions finished", ["language", "status"], registry=REGISTRY)
RUN_SECONDS = Histogram("tide_sandbox_run_seconds", "Wall time of one execution (queueing excluded)", ["language"],
                        buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=REGISTRY)
REJECTED = Counter("tide_sandbox_rejected", "Requests answered 503 because the queue was full", registry=REGISTRY)
BUSY = Gauge("tide_sandbox_busy_slots", "Slots running an execution", registry=REGISTRY)
QUEUED = Gauge("tide_sandbox_queued", "Executions accepted and waiting for a slot", registry=REGISTRY)
BROKEN = Gauge("tide_sandbox_broken_slots", "Slots taken out of service (a process would not die)",
               registry=REGISTRY)
SESSIONS = Gauge("tide_sandbox_sessions", "Live sessions (each on a seat of its own, beside the run pool)",
                 registry=REGISTRY)
