"""Shared benchmark plumbing (BENCHMARKS.md): alternating A/B samples, medians, ratios, one JSON format."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    versions = {}
    for mod in ("torch", "vllm", "megatron.core", "ray", "transformers", "jax", "mooncake"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            versions[mod] = getattr(m, "__version__", "?")
        except Exception:
            pass
    return {"cores": os.cpu_count(), "cpu": cpu, "versions": versions}


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


@dataclass
class Report:
    area: str
    quick: bool
    results: list[dict] = field(default_factory=list)
    goals: list[dict] = field(default_factory=list)

    def add(self, name: str, contender: str, baseline: str, metric: str, a: list[float], b: list[float],
            higher_is_better: bool = True, **extra) -> dict:
        ma, mb = statistics.median(a), statistics.median(b)
        row = {"name": name, "contender": contender, "baseline": baseline, "metric": metric,
               "samples_contender": a, "samples_baseline": b, "contender_median": ma, "baseline_median": mb,
               "contender_spread": [min(a), max(a)], "baseline_spread": [min(b), max(b)],
               "ratio": ma / mb if mb else float("inf"), "higher_is_better": higher_is_better, **extra}
        self.results.append(row)
        return row

    def goal(self, name: str, ratio: float, target: float) -> None:
        self.goals.append({"name": name, "ratio": ratio, "target": target, "met": ratio >= target})

    def write(self) -> Path:
        out = ROOT / "bench_results" / f"{self.area}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps({"area": self.area, "machine": machine(), "quick": self.quick,
                                   "results": self.results, "goals": self.goals}, indent=1))
        return out

    def print_table(self) -> None:
        print(f"\n{self.area}: median (min-max), ratio = contender / baseline")
        for r in self.results:
            print(f"  {r['name']:<34} {r['metric']:<14} {r['contender_median']:>10.4g} "
                  f"({r['contender_spread'][0]:.3g}-{r['contender_spread'][1]:.3g})  vs {r['baseline']}: "
                  f"{r['baseline_median']:.4g}  ratio {r['ratio']:.3f}")
        for g in self.goals:
            print(f"  goal {g['name']}: {g['ratio']:.3f} (target {g['target']}) {'met' if g['met'] else 'NOT met'}")

    def finish(self) -> Path:
        """Write the JSON, print the table and where the JSON went: the end of every bench run."""
        out = self.write()
        self.print_table()
        print(f"wrote {out}")
        return out
