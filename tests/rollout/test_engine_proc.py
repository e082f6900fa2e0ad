"""The process helpers the engine teardown and the rollout group's shutdown rely on (no vLLM needed)."""
import os
import subprocess
import time

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
