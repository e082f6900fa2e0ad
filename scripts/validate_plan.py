"""`tide plan` against measured memory: runs shipped configs (a few iterations each, under the suite's lock
/tmp/tide-pytest.lock) while polling the VmHWM (peak resident set) of every process the run starts, and prints the
planner's figure per trainer rank and per engine beside the largest measured one and their ratio.

    .venv/bin/python scripts/validate_plan.py                  # the default configs
    .venv/bin/python scripts/validate_plan.py configs/dp2.yaml  # chosen ones
    .venv/bin/python scripts/validate_plan.py --calibrate       # the process baselines the planner adds on cpu
    .venv/bin/python scripts/validate_plan.py --step 1024 2048  # one train step of a 34M model at these lengths

--calibrate measures what trainer/memory_plan.py's CPU_RANK_BASELINE holds: the VmHWM of a Ray actor that imports
the rank's modules and builds a MegatronWorker of the quickstart's tiny model (the quickstart run must have built
it: .cache/tide). The engine's baseline (rollout/memory_plan.py) is the quickstart engine's VmHWM less its KV cache
and weights, which this table's quickstart row shows. Goal (issue 61): planned within 20% of measured."""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LOCK = "/tmp/tide-pytest.lock"
CONFIGS = ["configs/quickstart.yaml", "configs/quickstart_bf16.yaml", "configs/dp2.yaml", "configs/tp2.yaml",
           "configs/moe_ep2.yaml"]
# short runs: the peak of a rank is its train step (and its start-up), which every iteration repeats
SHORT = ["iterations=3", "save_every=2", "trainer.warmup_sft_steps=2"]
POLL_S = 0.2


def _children(root: int) -> set[int]:
    by_parent: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            by_parent.setdefault(ppid, []).append(int(d))
    out, stack = set(), [root]
    while stack:
        for c in by_parent.get(stack.pop(), []):
            out.add(c)
            stack.append(c)
    return out


def _kind(cmdline: str) -> str | None:
    if cmdline.startswith("ray::_Rank"):
        return "rank"
    if cmdline.startswith("ray::RolloutEngine"):
        return "engine"
    if "tide run" in cmdline or cmdline.endswith("tide"):
        return "driver"
    return None


def measure(argv: list[str]) -> dict[str, float]:
    """Run `argv`; the largest VmHWM (MiB) of each kind of process (a pid's kind is the last seen: a Ray worker
    becomes a rank)."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    hwm: dict[int, float] = {}
    kinds: dict[int, str] = {}
    while proc.poll() is None:
        for pid in _children(proc.pid) | {proc.pid}:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
            except OSError:
                continue
            kind = _kind(cmd) or ("driver" if pid == proc.pid else None)
            if kind and "VmHWM:" in status:
                kinds[pid] = kind
                hwm[pid] = max(hwm.get(pid, 0.0), int(status.split("VmHWM:")[1].split()[0]) / 1024)
        time.sleep(POLL_S)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
    out: dict[str, float] = {}
    for pid, kind in kinds.items():
        out[kind] = max(out.get(kind, 0.0), hwm[pid])
    return out


def planned(config: str) -> dict[str, float]:
    from orchestrator.config.schema import load_config, parse_overrides
    from orchestrator.run.plan import CPU_DRIVER, plan

    p = plan(load_config(ROOT / config, parse_overrides(SHORT)))
    gib = 1024.0
    return {"rank": p.rank["total"] * gib, "engine": p.engine["total"] * gib, "driver": CPU_DRIVER / 2**20,
            "rank_model": (p.rank["total"] - p.rank["baseline"]) * gib}


def calibrate() -> None:
    import ray

    from orchestrator.config.schema import load_config
    from orchestrator.run.plan import model_shape

    _, model_dir = model_shape(load_config(ROOT / "configs/quickstart.yaml"))

    @ray.remote
    class Baseline:
        def measure(self, hf_dir: str) -> float:
            import socket

            from trainer.config import TrainerSpec
            from trainer.megatron.worker import MegatronWorker

            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            self.worker = MegatronWorker(TrainerSpec(hf_dir=hf_dir), 0, 1, "127.0.0.1", port)
            return int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) / 1024

    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            print(f"trainer rank baseline (VmHWM of a tiny MegatronWorker in a Ray actor): "
                  f"{ray.get(Baseline.remote().measure.remote(model_dir)):.0f} MiB")
        finally:
            ray.shutdown()


# --step's model: big enough that weights, Adam and activations outweigh the process (34M parameters), small
# enough for a step of a few thousand positions on this machine's two cores
STEP_MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8, intermediate_size=2048,
                  max_position_embeddings=16384)


def step_child(hf_dir: str, length: int, attention: str, recompute: str) -> None:
    """In its own process: a MegatronWorker of `hf_dir`, one supervised train step on one sequence of `length`
    positions, twice; prints the VmHWM (MiB) after building the worker and after the steps."""
    import socket

    from trainer.batch import TrainBatch, TrainSequence
    from trainer.config import TrainerConfig, TrainerSpec
    from trainer.megatron.worker import MegatronWorker

    def hwm() -> float:
        return int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) / 1024

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    trainer = TrainerConfig(attention=attention, recompute=recompute, micro_batch_size=1)
    worker = MegatronWorker(TrainerSpec(hf_dir=hf_dir, trainer=trainer), 0, 1, "127.0.0.1", port)
    built = hwm()
    ids = [(7 * i) % 200 + 1 for i in range(length + 1)]
    for _ in range(2):  # the second step is the steady state: Adam's moments exist through forward and backward
        worker.train_step(TrainBatch([TrainSequence(prompt_ids=ids[:1], completion_ids=ids[1:])]), mode="sft")
    print(json.dumps({"built_mib": built, "peak_mib": hwm()}))


def step_rows(lengths: list[int], attentions: list[str], recomputes: list[str]) -> list[dict]:
    """Planned vs measured for one train step of STEP_MODEL per (length, attention, recompute). The measured
    figure is the step's process VmHWM less that of the same process with a tiny model built (the baseline of a
    process outside Ray), the planned one the planner's total less its baseline."""
    from rollout.tasks import AdditionTask
    from trainer.memory_plan import ModelShape, single_step_memory
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    cache = ROOT / ".cache" / "tide"
    big = build_tiny_model(cache / "validate-plan-34m", AdditionTask().corpus(), TinyModelConfig(**STEP_MODEL))
    tiny = build_tiny_model(cache / "validate-plan-tiny", AdditionTask().corpus(), TinyModelConfig())
    cfg = json.loads((big / "config.json").read_text())
    shape = ModelShape(layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], ffn=cfg["intermediate_size"],
                       heads=cfg["num_attention_heads"], kv_heads=cfg["num_key_value_heads"],
                       head_dim=cfg["head_dim"], vocab=cfg["vocab_size"], qkv_bias=True)

    def child(hf_dir: Path, length: int, attention: str, recompute: str) -> dict:
        with open(LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            out = subprocess.run([sys.executable, __file__, "--step-child", str(hf_dir), str(length), attention,
                                  recompute], cwd=ROOT, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    base = child(tiny, 8, "sdpa", "none")["peak_mib"]
    rows = []
    print(f"{'length':<8} {'attn':<5} {'recompute':<9} {'planned MiB':>12} {'measured MiB':>13} {'ratio':>6}")
    for length in lengths:
        for attention in attentions:
            for recompute in recomputes:
                got = child(big, length, attention, recompute)["peak_mib"] - base
                m = single_step_memory(shape, length, attention=attention, recompute=recompute)
                plan_mib = (m.total - m.baseline) / 2**20
                rows.append({"length": length, "attention": attention, "recompute": recompute,
                             "planned_mib": round(plan_mib, 1), "measured_mib": round(got, 1),
                             "ratio": round(plan_mib / got, 3)})
                print(f"L={length:<6} {attention:<5} {recompute:<9} {plan_mib:12.1f} {got:13.1f} "
                      f"{plan_mib / got:6.2f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*", default=CONFIGS)
    ap.add_argument("--calibrate", action="store_true", help="measure the CPU rank baseline instead")
    ap.add_argument("--step", type=int, nargs="+", metavar="L", help="instead: one train step of a 34M model at "
                    "these lengths (model memory above the process's baseline)")
    ap.add_argument("--attention", nargs="+", default=["sdpa", "eager"], help="with --step")
    ap.add_argument("--recompute", nargs="+", default=["none", "full"], help="with --step")
    ap.add_argument("--step-child", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    if args.step_child:
        hf_dir, length, attention, recompute = args.step_child
        step_child(hf_dir, int(length), attention, recompute)
        return
    if args.calibrate:
        calibrate()
        return
    if args.step:
        rows = step_rows(args.step, args.attention, args.recompute)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return
    rows = []
    print(f"{'config':<30} {'process':<7} {'planned MiB':>12} {'measured MiB':>13} {'ratio':>6}")
    for config in args.configs:
        plan_mib = planned(config)
        with tempfile.TemporaryDirectory(prefix="tide-validate-plan-") as tmp, open(LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            got = measure([str(ROOT / ".venv/bin/tide"), "run", config, *SHORT, "--run-dir", f"{tmp}/run"])
        for kind in ("rank", "engine", "driver"):
            if kind in got:
                ratio = plan_mib[kind] / got[kind]
                rows.append({"config": config, "process": kind, "planned_mib": round(plan_mib[kind], 1),
                             "measured_mib": round(got[kind], 1), "ratio": round(ratio, 3)})
                print(f"{config:<30} {kind:<7} {plan_mib[kind]:12.1f} {got[kind]:13.1f} {ratio:6.2f}", flush=True)
    within = [r for r in rows if r["process"] != "driver" and abs(r["ratio"] - 1) <= 0.2]
    print(f"{len(within)} of {sum(r['process'] != 'driver' for r in rows)} rank/engine figures within 20%")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
