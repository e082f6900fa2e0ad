"""A run's directory: metrics, phase timings, samples, checkpoints' layout, status and the lock that keeps one
process writing it (rundir.py, run_lock.py), and the loggers it feeds (TensorBoard, Weights & Biases)."""
from orchestrator.records.run_lock import RunDirBusy, hold_run_dir
from orchestrator.records.rundir import PhaseRecord, RunDir, read_jsonl

__all__ = ["PhaseRecord", "RunDir", "RunDirBusy", "hold_run_dir", "read_jsonl"]
