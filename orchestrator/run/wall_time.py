"""A run's timings read as wall time (`tide inspect`, its plots, the benchmarks): each instant counted once, by
what ran then (one phase alone, two or more at once: `overlapped`, none: `untimed`), per run, per process of a
resumed run and per iteration, and how long each side (engines, trainer) sat idle."""
from __future__ import annotations

import bisect
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field

PHASE_ORDER = ["startup/ray", "startup/trainer", "startup/engines", "startup/engine_sync", "warmup", "compile",
               "rollout", "rollout_ahead", "reward", "old_logprobs", "reference", "train", "publish", "drain",
               "ahead_check", "sync", "probe", "eval", "checkpoint"]
# Timed while other phases ran (rollout.max_staleness 1: the next batch sampled during train and publish)
OVERLAPPED = {"rollout_ahead"}
# A process's first phase (an LLM run's Ray start, a JAX run's compilation): a restarted run's records form a
# session of their own, and the time between two sessions (the fault, the restart's back-off) is no wall time
SESSION_OPENERS = {"startup/ray", "compile"}
# Which side of an LLM run each phase keeps busy (the reward, the drain and the probe's scoring: the driver's)
ROLE_PHASES = {"engines": {"rollout", "rollout_ahead", "sync", "probe", "eval"},
               "trainer": {"old_logprobs", "reference", "train", "publish", "ahead_check", "checkpoint"}}


def is_startup(phase: str) -> bool:
    """Recorded under the iteration a run starts from, but no part of it."""
    return phase.startswith("startup/") or phase == "warmup"


def phase_key(phase: str) -> tuple[int, str]:
    return PHASE_ORDER.index(phase) if phase in PHASE_ORDER else len(PHASE_ORDER), phase


@dataclass
class WallTime:
    """Wall time split by what ran at each instant. alone: a phase's seconds with no other phase running;
    beside: a phase's seconds while another ran too; overlapped: the seconds two or more phases ran (each counted
    once), by which phases (`together`); untimed: no phase ran. wall = sum(alone) + overlapped + untimed."""
    wall: float = 0.0
    alone: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    beside: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    together: dict[tuple[str, ...], float] = field(default_factory=lambda: defaultdict(float))
    overlapped: float = 0.0
    untimed: float = 0.0

    def credit(self, running: tuple[str, ...], seconds: float) -> None:
        if not running:
            self.untimed += seconds
        elif len(running) == 1:
            self.alone[running[0]] += seconds
        else:
            self.overlapped += seconds
            self.together[running] += seconds
            for p in running:
                self.beside[p] += seconds

    def add(self, other: WallTime) -> None:
        self.wall += other.wall
        self.overlapped += other.overlapped
        self.untimed += other.untimed
        for mine, theirs in ((self.alone, other.alone), (self.beside, other.beside),
                             (self.together, other.together)):
            for k, v in theirs.items():
                mine[k] += v


def split_wall_time(records: list[dict], lo: float, hi: float) -> WallTime:
    """The span lo..hi split by the phases of `records` running at each instant (clipped to the span)."""
    lo, hi = round(lo, 6), round(hi, 6)
    out = WallTime(wall=max(hi - lo, 0.0))
    events = []
    for r in records:  # to the microsecond, so that one phase's end meets the next one's start
        a, b = round(max(r["start"], lo), 6), round(min(r["start"] + r["seconds"], hi), 6)
        if b > a:
            events += [(a, 1, r["phase"]), (b, -1, r["phase"])]
    events.sort(key=lambda e: (e[0], e[1]))  # at one instant, what ends before what starts
    active: Counter[str] = Counter()
    now = lo
    for when, step, phase in events:
        if when > now:
            out.credit(tuple(sorted(active, key=phase_key)), when - now)
            now = when
        active[phase] += step
        if not active[phase]:
            del active[phase]
    if hi > now:
        out.untimed += hi - now
    return out


def session_starts(timings: list[dict]) -> list[float]:
    return sorted(r["start"] for r in timings if r["phase"] in SESSION_OPENERS)


def sessions(timings: list[dict]) -> list[list[dict]]:
    """The records of each process that ran the run (one, unless it was resumed or restarted), in time order."""
    opens = session_starts(timings)
    out: dict[int, list[dict]] = defaultdict(list)
    for r in timings:
        out[bisect.bisect_right(opens, r["start"])].append(r)
    return [out[k] for k in sorted(out)]


def wall_time(timings: list[dict]) -> WallTime:
    """Each session's span from its first phase's start to its last phase's end, split by what ran."""
    total = WallTime()
    for recs in sessions(timings):
        total.add(split_wall_time(recs, min(r["start"] for r in recs), max(r["start"] + r["seconds"] for r in recs)))
    return total


def phase_table(timings: list[dict]) -> list[dict]:
    """A row per phase (count, median, total, the seconds it ran beside another phase, share: its time alone over
    the wall time), then `overlapped` and `untimed` (their seconds in total_s): the shares add to 1."""
    by_phase: dict[str, list[float]] = defaultdict(list)
    for r in timings:
        by_phase[r["phase"]].append(r["seconds"])
    split = wall_time(timings)
    wall = split.wall or 1.0
    rows = [{"phase": p, "count": len(by_phase[p]), "median_s": statistics.median(by_phase[p]),
             "total_s": sum(by_phase[p]), "overlapped_s": split.beside.get(p, 0.0),
             "share": split.alone.get(p, 0.0) / wall} for p in sorted(by_phase, key=phase_key)]
    rows.append({"phase": "overlapped", "total_s": split.overlapped, "share": split.overlapped / wall})
    rows.append({"phase": "untimed", "total_s": split.untimed, "share": split.untimed / wall})
    return rows


def iteration_ends(timings: list[dict]) -> dict[int, float]:
    """Each iteration's end: the latest end of its phases (a batch drawn ahead ends before its iteration does;
    the start-up, recorded under the iteration a resumed run starts from, is not part of it)."""
    ends: dict[int, float] = {}
    for t in timings:
        if isinstance(t.get("iteration"), int) and t["iteration"] > 0 and not is_startup(t["phase"]):
            ends[t["iteration"]] = max(ends.get(t["iteration"], 0.0), t["start"] + t["seconds"])
    return ends


def iteration_windows(timings: list[dict]) -> dict[int, tuple[float, float]]:
    """Each iteration's wall-clock span: from the end of the one before (in the same session; else from its first
    phase, a batch drawn ahead left out) to its end. The spans tile the steady state, so that the time a batch is
    drawn ahead falls in the iteration it ran during."""
    ends, opens = iteration_ends(timings), session_starts(timings)
    first: dict[int, float] = {}
    for r in timings:
        it = r.get("iteration")
        if it in ends and not is_startup(r["phase"]) and r["phase"] not in OVERLAPPED:
            first[it] = min(first.get(it, r["start"]), r["start"])
    out = {}
    for it in sorted(ends):
        prev = ends.get(it - 1)
        same = prev is not None and bisect.bisect_right(opens, prev) == bisect.bisect_right(opens, ends[it])
        out[it] = (prev if same and prev < ends[it] else first.get(it, ends[it]), ends[it])
    return out


def per_iteration(timings: list[dict]) -> dict[int, WallTime]:
    windows = iteration_windows(timings)
    steady = [r for r in timings if not is_startup(r["phase"])]
    return {it: split_wall_time(steady, lo, hi) for it, (lo, hi) in windows.items()}


def idle_shares(timings: list[dict]) -> dict[str, float] | None:
    """Over the iterations after the first (start-up, compilation and first-use warm-up left out, and a resumed
    run's time between its processes): the share of that time each role's phases left it idle, overlapping
    phases counted once. None: fewer than two iterations."""
    windows = [w for it, w in sorted(iteration_windows(timings).items())[1:]]
    span = sum(hi - lo for lo, hi in windows)
    if not windows:
        return None
    out = {}
    for role, phases in ROLE_PHASES.items():
        busy = 0.0
        for lo, hi in windows:
            spans = sorted((max(r["start"], lo), min(r["start"] + r["seconds"], hi)) for r in timings
                           if r["phase"] in phases)
            reach = lo
            for a, b in spans:  # the union of the spans, clipped to the window
                a = max(a, reach)
                if b > a:
                    busy, reach = busy + b - a, b
        out[role] = 1.0 - busy / span if span > 0 else 0.0
    return out
