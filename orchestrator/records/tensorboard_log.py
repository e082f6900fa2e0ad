"""TensorBoard event files under RUN_DIR/tb/: every metric of metrics.jsonl under its own name and every
phase's seconds as `time/<phase>`, stepped by iteration (torch's SummaryWriter; `tensorboard --logdir RUN_DIR/tb`).
"""
from __future__ import annotations

import math
from numbers import Real
from pathlib import Path


class TensorBoardLog:
    def __init__(self, logdir: Path, purge_step: int | None = None) -> None:
        """`purge_step`: on resume, the first iteration run again; TensorBoard hides what earlier event files
        recorded from that step on, so a redone iteration is not drawn twice."""
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(logdir), purge_step=purge_step, flush_secs=30)

    def scalars(self, step: int, values: dict, prefix: str = "") -> None:
        for name, value in values.items():
            if name == "iteration" or isinstance(value, bool) or not isinstance(value, Real):
                continue
            if math.isfinite(value):
                self._writer.add_scalar(prefix + name, float(value), step)

    def samples(self, step: int, records: list[dict]) -> None:
        """Completions to read, as a markdown table under the TEXT tab (`samples`)."""
        def cell(value) -> str:
            text = f"{value:.4g}" if isinstance(value, float) else str(value)
            return text.replace("|", "\\|").replace("\n", "<br>")

        header = ["prompt", "completion", "reward", "completion_tokens", "finish_reason"]
        rows = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        rows += ["| " + " | ".join(cell(r.get(k)) for k in header) + " |" for r in records]
        self._writer.add_text("samples", "\n".join(rows), step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
