"""How a run that stops on an error says so: the reason first, in one line; the whole traceback in RUN_DIR/error.log
(each attempt's appended under a header); the exit code that tells `--max-restarts` whether to try again.

An error in the user's input or code -- the config (ConfigError), the dataset (TaskDataError) or a reward function
that raised, hung or returned something else than one number per completion (RewardFunctionError), a tool or
function that cannot be imported (UserFunctionError) -- is deterministic: the same run fails the same way again, so it
exits 2 and is never retried, and the console shows the user's own traceback (a reward function's, from the worker
process it ran in). Anything else is a fault (exit 1: a rank or an engine died, the Ray head went away), retried by
`--max-restarts`, its traceback left to error.log so the reason is what a terminal shows."""
from __future__ import annotations

import time
import traceback
from pathlib import Path

from orchestrator.config.schema import ConfigError
from orchestrator.rewards.functions import RewardFunctionError
from rollout import UserFunctionError
from rollout.tasks import TaskDataError

ERROR_LOG = "error.log"
INPUT_ERRORS = (ConfigError, TaskDataError, RewardFunctionError, UserFunctionError)  # exit 2, never retried
INPUT_EXIT, FAULT_EXIT = 2, 1


def exit_code(error: BaseException) -> int:
    return INPUT_EXIT if isinstance(error, INPUT_ERRORS) else FAULT_EXIT


def reason(error: BaseException) -> str:
    """The one line a terminal shows first."""
    if isinstance(error, (ConfigError, TaskDataError, UserFunctionError)):
        return str(error)  # written for the user already, naming the field or row
    return f"error: {type(error).__name__}: {error}"


def user_traceback(error: BaseException) -> str | None:
    """The traceback of the user's own code, when `error` came from it: a reward function's, as its worker
    process raised it."""
    return getattr(error, "user_traceback", None)


def write_error_log(run_dir: Path, error: BaseException) -> Path:
    """Append `error`'s whole traceback (the user's code's first, when it came from there) to RUN_DIR/error.log."""
    path = Path(run_dir) / ERROR_LOG
    parts = [f"===== {time.strftime('%Y-%m-%d %H:%M:%S')}: {reason(error)}\n"]
    if (users := user_traceback(error)) is not None:
        parts += ["--- the user's code (in the process that ran it):\n", users.rstrip("\n") + "\n",
                  "--- where tide met it:\n"]
    parts += traceback.format_exception(error)
    with path.open("a") as f:
        f.write("".join(parts) + "\n")
    return path


def console_report(error: BaseException, log: Path | None) -> str:
    """What the terminal shows: the reason; for the user's code its traceback too; where the rest is."""
    lines = [reason(error)]
    if (users := user_traceback(error)) is not None:
        lines.append(users.rstrip("\n"))
    if log is not None:
        lines.append(f"(the whole traceback: {log})")
    return "\n".join(lines)
