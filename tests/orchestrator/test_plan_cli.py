"""`tide plan`: the quickstart's plan as JSON (no run), and a layout that does not fit with the changes that make
it fit (exit 1)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def _plan(config: str, *args: str) -> SimpleNamespace:
    """`tide plan` through its command-line interface, in this process (it starts nothing): exit code, stdout,
    stderr."""
    from typer.testing import CliRunner

    from orchestrator.run import cli

    result = CliRunner().invoke(cli.app, ["plan", str(ROOT / config), *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=result.stderr)


def test_quickstart_plan_as_json():
    proc = _plan("configs/quickstart.yaml", "--json")
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    assert p["fits"] and p["device"] == "cpu" and p["ranks"] == 1 and p["engines"] == 1
    assert p["parameters"] == 115264  # tests/trainer/test_memory_plan.py works it out
    parts = ("baseline", "weights", "gradients", "optimizer", "activations", "logits", "logprob_chunk", "allocator")
    assert abs(sum(p["rank"][k] for k in parts) - p["rank"]["total"]) < 0.01
    assert p["engine"]["kv_cache"] == 0.25  # rollout.kv_cache_gb
    # single-digit addition: a short prompt, found by rendering the task's prompts; 128 rows a micro-batch (512
    # samples over 4 mini-batches)
    assert p["lengths"]["prompt_source"].startswith("longest of") and p["lengths"]["prompt_tokens"] < 16
    assert p["lengths"]["micro_batch_rows"] == 128
    assert any("baseline" in note for note in p["notes"])  # a tiny model: the process is most of it


def test_a_layout_that_does_not_fit_gets_changes():
    proc = _plan("configs/quickstart.yaml", "trainer.device=cuda", "trainer.backend=nccl", "trainer.attention=eager",
                 "--prompt-tokens", "3000", "--gpu-memory-gb", "4", "--json")
    assert proc.returncode == 1, proc.stderr
    p = json.loads(proc.stdout)
    assert not p["fits"] and p["problems"][0].startswith("a trainer rank needs")
    by = p["activations_by_recompute_gb"]
    assert by["none"] > by["selective"] > by["full"]  # eager: selective drops the [heads, L, L] scores
    changes = {c["setting"]: c for c in p["changes"]}
    assert not changes["trainer.attention=sdpa"]["fits"] and changes["trainer.attention=sdpa"]["rank_gb"] < \
        p["rank"]["total"]
    assert any(c["fits"] for c in p["changes"])


def test_a_trainer_spanning_nodes_is_reported_per_node():
    """placement.trainer_nodes 2 with a pipeline stage per node: each node's ranks and coordinates, its share of
    the published checkpoint (the shares sum to it, neither holds it whole) and whether --shm-gb holds the kept
    iterations."""
    spread = ("configs/quickstart.yaml", "trainer.parallel.pp=2", "trainer.parallel.dp=2",
              "placement.trainer_nodes=2", "transfer.enabled=true", "model.tiny.hidden_size=256",
              "model.tiny.intermediate_size=1024", "--json")
    proc = _plan(*spread, "--shm-gb", "1")
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    assert p["trainer_nodes"] == 2 and [n["stages"] for n in p["nodes"]] == [[0], [1]]
    assert [[r["rank"] for r in n["ranks"]] for n in p["nodes"]] == [[0, 1], [2, 3]]
    assert [n["replicas"] for n in p["nodes"]] == [[0, 1], [0, 1]]
    shares = [n["published_bytes"] for n in p["nodes"]]
    assert sum(shares) == p["checkpoint_bytes"] == p["parameters"] * 4 and all(0 < s < p["checkpoint_bytes"]
                                                                             for s in shares)
    assert all(n["shm_fits"] for n in p["nodes"])
    proc = _plan(*spread, "--shm-gb", "0.005")  # 5 MiB: not 3 copies (publish.keep_last 2 + 1) of ~4 MB
    assert proc.returncode == 1
    p = json.loads(proc.stdout)
    assert [n["shm_fits"] for n in p["nodes"]] == [False, False]
    assert p["problems"][0].startswith("node 0 needs") and "shared memory" in p["problems"][0]
