"""logging.wandb: an offline W&B run beside TensorBoard with the same scalars, continued (same id) by a resume,
and refused at start-up, naming the field, where wandb is not installed."""
import glob
import json
import struct
from pathlib import Path

import pytest

from orchestrator.config.schema import ConfigError, parse_config
from orchestrator.records.rundir import PhaseRecord, RunDir
from orchestrator.records.wandb_log import WandbConfig, WandbLog

pytest.importorskip("wandb")  # the dev extra installs it


def _history(wandb_file: str) -> list[dict]:
    """History rows of an offline run's .wandb file: a 7-byte header, then LevelDB-log records (32 KiB blocks;
    each chunk: crc32, little-endian length, type FULL/FIRST/MIDDLE/LAST) holding protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, rows, pending = Path(wandb_file).read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_offline_run_holds_every_metric_and_phase_time_and_a_resume_continues_it(tmp_path):
    def session(first: int, last: int) -> None:
        run = RunDir(tmp_path / "run")
        run.attach(WandbLog(run.path, WandbConfig(), "demo", {"seed": 1}))
        for it in range(first, last + 1):
            run.record_phase(PhaseRecord(it, "rollout", 0.0, 0.5 * it, None))
            run.log_metrics({"iteration": it, "reward_mean": it / 10, "deterministic": True})
        run.close()

    session(1, 2)
    session(3, 3)
    files = sorted(glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb")))
    run_id = (tmp_path / "run" / "wandb_id").read_text()
    assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files)  # one W&B run, resumed
    rows = [r for f in files for r in _history(f)]
    steps = {r["_step"]: r for r in rows}
    assert sorted(steps) == [1, 2, 3]
    for it in (1, 2, 3):
        merged = {k: v for r in rows if r["_step"] == it for k, v in r.items()}
        assert merged["reward_mean"] == pytest.approx(it / 10) and merged["time/rollout"] == pytest.approx(0.5 * it)
        assert "deterministic" not in merged and "iteration" not in merged


def test_wandb_section_without_the_package_is_refused_naming_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logging\.wandb.*wandb package is not installed"):
        parse_config({"name": "x", "iterations": 1, "logging": {"wandb": {"project": "p"}}})
