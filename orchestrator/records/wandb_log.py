"""Weights & Biases logging (`logging.wandb`), the same scalars as TensorBoard: every metric under its own name
and every phase's seconds as `time/<phase>`, stepped by iteration. Offline by default (files under
RUN_DIR/wandb/, uploaded later with `wandb sync`), since training nodes often have no route out. The run id is
kept in RUN_DIR/wandb_id so that `tide resume` continues the same W&B run; W&B ignores steps below the last one
it saw, so iterations redone after a resume keep their first values there (metrics.jsonl and TensorBoard hold
the redone ones)."""
from __future__ import annotations

import math
import secrets
from numbers import Real
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from ckpt_transfer.config import StrictModel


class WandbConfig(StrictModel):

    project: str = Field("tide", description="W&B project of the run.")
    entity: str | None = Field(None, description="W&B entity (user or team); null: your default entity.")
    name: str | None = Field(None, description="W&B run name; null: the config's `name`.")
    mode: Literal["offline", "online"] = Field(
        "offline", description="`offline`: files under RUN_DIR/wandb, uploaded later with `wandb sync`; `online`: "
        "logged as the run goes (needs a W&B login and a route out).")
    tags: list[str] = Field([], description="W&B tags of the run.")


class WandbLog:
    def __init__(self, run_dir: Path, cfg: WandbConfig, run_name: str, config: dict[str, Any]) -> None:
        import wandb

        id_file = run_dir / "wandb_id"
        if not id_file.is_file():
            id_file.write_text(secrets.token_hex(4))  # W&B ids: [a-z0-9]
        self._run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or run_name, mode=cfg.mode,
                               tags=cfg.tags, dir=str(run_dir), id=id_file.read_text().strip(), resume="allow",
                               config=config)

    def scalars(self, step: int, values: dict, prefix: str = "") -> None:
        data = {prefix + k: float(v) for k, v in values.items()
                if k != "iteration" and not isinstance(v, bool) and isinstance(v, Real) and math.isfinite(v)}
        if data and step >= (self._run.step or 0):
            self._run.log(data, step=step)

    def samples(self, step: int, records: list[dict]) -> None:
        """Completions to read, as a W&B table (`samples`)."""
        import wandb

        if records and step >= (self._run.step or 0):
            columns = list(records[0])
            table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in records])
            self._run.log({"samples": table}, step=step)

    def flush(self) -> None:
        pass  # wandb writes from its own process

    def close(self) -> None:
        import wandb

        self._run.finish()
        # finish() only informs W&B's service process that the run is over; the service closes the run's .wandb
        # file later, on its own time. Tearing the service down waits for that, so the offline files are
        # complete when close() returns (a resume or `wandb sync` right after reads every step).
        wandb.teardown()
