"""The integration tests' runs: tide through its CLI as a user starts it, and a resumed run held against the
uninterrupted one."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIDE = [sys.executable, "-m", "orchestrator.run.cli"]


def tide(*args, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*TIDE, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw)


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


def resume_cut_back(whole: Path, cut: Path, iteration: int, timeout: float = 900) -> None:
    """A copy of the finished run `whole` in `cut`, cut back to its iteration-`iteration` checkpoint as a run
    killed after that checkpoint is (later checkpoints and final.json gone), then `tide resume`d to its end."""
    shutil.copytree(whole, cut)
    later = [p for p in (cut / "checkpoints").iterdir()
             if (m := re.fullmatch(r"iter_(\d+)", p.name)) and int(m.group(1)) > iteration]
    assert later and (cut / "checkpoints" / f"iter_{iteration:07d}").is_dir(), sorted((cut / "checkpoints").iterdir())
    for path in later:
        shutil.rmtree(path)
    (cut / "final.json").unlink()
    resumed = tide("resume", cut, timeout=timeout)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
