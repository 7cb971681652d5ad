"""What the benchmarks count as a side's CPU (bench/common.py): a process tree's exited
workers and the kernel's softirq threads are in it; and the harness's reads stay below
the size at which malloc maps each buffer."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.common import RECV_BYTES, proc_cpu_s, process_tree_cpu_seconds, softirq_threads, tree_cpu_s

BURN = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end:\n    pass\n"


def _own_tree_cpu_s() -> float:
    return tree_cpu_s([os.getpid()])


def test_a_child_that_exited_within_the_window_is_counted_in_its_parents_tree():
    before, before_tree = _own_tree_cpu_s(), process_tree_cpu_seconds(os.getpid())
    own_before = proc_cpu_s(os.getpid())
    subprocess.run([sys.executable, "-c", BURN], check=True)  # lives and is waited for in between
    own_spent = proc_cpu_s(os.getpid()) - own_before
    assert _own_tree_cpu_s() - before - own_spent >= 0.25
    assert process_tree_cpu_seconds(os.getpid()) - before_tree - own_spent >= 0.25


def test_the_kernels_softirq_threads_are_found():
    threads = softirq_threads()
    assert threads  # one per CPU on every Linux kernel
    for pid in threads:
        with open(f"/proc/{pid}/comm") as comm:
            assert comm.read().startswith("ksoftirqd/")
    assert os.getpid() not in threads


def test_harness_reads_stay_below_mallocs_mmap_threshold():
    # glibc maps allocations of 128 KiB and more by default (M_MMAP_THRESHOLD).
    assert RECV_BYTES < 128 * 1024
