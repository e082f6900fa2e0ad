"""The process helpers the engine teardown and the rollout group's shutdown rely on (no vLLM needed)."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout.engine_proc import pids_alive, pin_threads, sweep_private_dirs, wait_gone


def test_wait_gone_returns_once_the_process_exits_and_counts_a_zombie_as_gone():
    proc = subprocess.Popen(["sleep", "0.2"])
    t0 = time.monotonic()
    assert wait_gone([proc.pid], timeout_s=10) == []  # not reaped yet: a zombie is gone
    assert time.monotonic() - t0 < 5
    proc.wait()


def test_wait_gone_gives_up_at_the_deadline_and_names_the_survivors():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        t0 = time.monotonic()
        assert wait_gone([proc.pid, 2**22 + 7], timeout_s=0.2) == [proc.pid]
        assert 0.2 <= time.monotonic() - t0 < 5
        assert pids_alive([proc.pid]) == [proc.pid]
    finally:
        proc.kill()
        proc.wait()


def test_private_dirs_of_gone_engines_are_swept_and_live_ones_kept(tmp_path):
    import os
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{gone.pid}-1"
    (dead / "torch-store").mkdir(parents=True)  # what a killed engine leaves: a non-empty directory
    live = tmp_path / f"{os.getpid()}-2"
    live.mkdir()
    other = tmp_path / "not-an-engine"
    other.mkdir()
    assert sweep_private_dirs(tmp_path) == [dead]
    assert not dead.exists() and live.is_dir() and other.is_dir()
    assert sweep_private_dirs(tmp_path / "absent") == []


def test_pin_threads_binds_every_thread_of_another_process_and_what_it_starts_later():
    """How a run binds its sandbox service to the engines' cores (placement.mode disaggregated): every thread of
    the process, and the processes it starts afterwards inherit it."""
    import sys

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one core: binding to it changes nothing")
    code = ("import os, subprocess, sys, threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "sys.stdout.write('up\\n'); sys.stdout.flush(); sys.stdin.readline()\n"
            "child = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'],"
            " capture_output=True, text=True)\n"
            "print(child.stdout.strip(), flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "up\n"
        pin_threads(cpus[:1], proc.pid)
        threads = os.listdir(f"/proc/{proc.pid}/task")
        assert len(threads) >= 2 and all(os.sched_getaffinity(int(t)) == set(cpus[:1]) for t in threads)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == str(cpus[:1])
    finally:
        proc.kill()
        proc.wait()
    pin_threads(cpus, 2**22 + 7)  # no such process: nothing to bind


def test_gc_paused_turns_the_collector_off_for_the_block_and_back_on_as_it_was():
    import gc

    from rollout.engine_proc import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested: the inner block leaves it off for the outer one
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ImportError):
        with gc_paused():
            raise ImportError("a failed import")
    assert gc.isenabled()  # back on after a failure too
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()


def test_freeze_heap_frees_the_garbage_first_and_keeps_the_rest_out_of_later_collections():
    import gc
    import weakref

    from rollout.engine_proc import freeze_heap

    class Node:
        pass

    garbage, kept = Node(), Node()
    garbage.self = garbage  # a cycle only a collection frees
    gone = weakref.ref(garbage)
    del garbage
    try:
        freeze_heap()
        assert gone() is None, "the garbage was frozen instead of freed"
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects()), "what is left was not frozen"
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())


_GLOO_RANK = r"""
import os, sys
import torch, torch.distributed as dist
from rollout.engine_proc import share_gloo_device
rank, port, shared = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
if shared:
    share_gloo_device()
    share_gloo_device()  # idempotent: one wrapper, one device
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
pairs = [dist.new_group([0, 1]) for _ in range(6)]
own = [dist.new_group([r]) for r in range(2)]
for k, group in enumerate(pairs):
    x = torch.full((1000,), float(rank + 1 + k))
    dist.all_reduce(x, group=group)
    assert torch.equal(x, torch.full((1000,), float(3 + 2 * k))), (k, x[:3])
pending = [(k, torch.full((4096,), float(rank + k))) for k in range(len(pairs))]
works = [dist.all_reduce(t, group=pairs[k], async_op=True) for k, t in pending]  # every group's traffic at once
for w in works:
    w.wait()
assert all(torch.equal(t, torch.full((4096,), float(1 + 2 * k))) for k, t in pending)
dist.broadcast(torch.zeros(3), src=rank, group=own[rank])
loops = sum(open(f"/proc/self/task/{t}/comm").read().strip() == "gloo_tcp_loop" for t in os.listdir("/proc/self/task"))
dist.barrier()
dist.destroy_process_group()
print(loops)
"""


@pytest.mark.parametrize("shared", [True, False])
def test_gloo_groups_share_one_device_and_its_loop_thread(shared):
    """share_gloo_device: the groups of a process (the world, six pairs, its own) run on one gloo device,
    so one loop thread (each of which wakes every 10 ms) instead of one per group; collectives on every group,
    concurrent ones too, give the same sums. Without it each group brings its own thread."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, "-c", _GLOO_RANK, str(r), str(port), "1" if shared else "0"],
                              cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    loops = [int(out.split()[-1]) for out, _ in outs]
    assert loops == ([1, 1] if shared else [8, 8]), loops  # the world, six pairs and its own group
