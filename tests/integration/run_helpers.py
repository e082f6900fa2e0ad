"""The integration tests' runs: tide through its CLI as a user starts it (`tide`), or in the test's own process
through its Python API on the session's pooled ranks and engines (`run_here`, `resume_here`: for tests of what a
run computes rather than of how its processes start, stop and fail), and a resumed run held against the
uninterrupted one."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIDE = [sys.executable, "-m", "orchestrator.run.cli"]


def tide(*args, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*TIDE, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw)


def threads_cpus(pid: int) -> set[tuple[int, ...]]:
    """The CPUs each thread of process `pid` may run on, as a set of distinct CPU tuples."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
        except ProcessLookupError:
            pass
    return out


def run_here(pools, config: Path, *overrides, run_dir: Path) -> Path:
    """`tide run config overrides --run-dir run_dir` in this process, on `pools` (the worker_pools fixture);
    raises what the run raised."""
    from orchestrator.run import api

    return api.run(config, [str(o) for o in overrides], run_dir, pools=pools).path


def resume_here(pools, run_dir: Path, iterations: int | None = None) -> Path:
    """`tide resume run_dir [--iterations N]` in this process, on `pools`."""
    from orchestrator.run import api

    return api.resume(run_dir, iterations, pools=pools).path


def assert_ends_as(run_dir: Path, whole: Path, files: tuple[str, ...] = ("metrics.jsonl", "samples.jsonl"),
                   final_key: str | None = "parameter_digests") -> None:
    """`run_dir` (resumed, perhaps several times) ended with the uninterrupted run `whole`'s `files` and final.json
    (its `final_key` entry only, or all of it with None)."""
    for name in files:
        assert (run_dir / name).read_text() == (whole / name).read_text(), name
    final, whole_final = (json.loads((d / "final.json").read_text()) for d in (run_dir, whole))
    if final_key is not None:
        final, whole_final = final[final_key], whole_final[final_key]
    assert final == whole_final


def resume_cut_back(whole: Path, cut: Path, iteration: int, timeout: float = 900, pools=None) -> None:
    """A copy of the finished run `whole` in `cut`, cut back to its iteration-`iteration` checkpoint as a run
    killed after that checkpoint is (later checkpoints and final.json gone), then `tide resume`d to its end (in
    this process on `pools`, when given)."""
    shutil.copytree(whole, cut)
    later = [p for p in (cut / "checkpoints").iterdir()
             if (m := re.fullmatch(r"iter_(\d+)", p.name)) and int(m.group(1)) > iteration]
    assert later and (cut / "checkpoints" / f"iter_{iteration:07d}").is_dir(), sorted((cut / "checkpoints").iterdir())
    for path in later:
        shutil.rmtree(path)
    (cut / "final.json").unlink()
    if pools is not None:
        resume_here(pools, cut)
        return
    resumed = tide("resume", cut, timeout=timeout)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
