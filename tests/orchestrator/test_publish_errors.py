"""A publish that runs out of room in publish.shm_root stops the run naming the root and what it must hold, also
when the error comes from a trainer rank through Ray (RayTaskError(OSError), errno only on its cause). The whole
path, a full tmpfs under a running job: tests/scripts/test_soak.py and scripts/soak.py's shm_full."""
from __future__ import annotations

import errno

from ray.exceptions import RayTaskError

from orchestrator.iteration.session import shm_full_error


def test_a_rank_out_of_space_is_named_with_the_publish_root(tmp_path):
    cause = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "quickstart" / "0000007" / "config.json"))
    from_rank = RayTaskError("_Rank.call", "traceback", cause).as_instanceof_cause()
    assert isinstance(from_rank, OSError) and from_rank.errno is None  # Ray's wrapper keeps no errno
    for e in (from_rank, cause):
        err = shm_full_error(e, 7, str(tmp_path), keep_last=2)
        assert isinstance(err, RuntimeError)
        msg = str(err)
        assert msg.startswith(f"publishing iteration 7 into publish.shm_root {tmp_path}: no space left on the device (")
        assert "MB free); it must hold publish.keep_last + 1 = 3 iterations" in msg and "config.json" in msg


def test_other_errors_pass_through():
    assert shm_full_error(OSError(errno.EACCES, "Permission denied"), 1, "/dev/shm/x", 2) is None
    assert shm_full_error(RayTaskError("f", "tb", FileNotFoundError(2, "gone")).as_instanceof_cause(), 1, "/x",
                          2) is None
