"""Keep a busy process's CPUs out of idle halt, as vLLM's and SGLang's busy loops do. Torch-free: the router uses it too.

Every round of speculation crosses processes: the router waits on a worker, the worker's gRPC thread hands the call
to its event loop and engine thread, and back. Each hand-over wakes a thread that sleeps on a CPU, and a CPU with
nothing to run halts. On a virtual machine that halt leaves the guest, and the wake-up costs far more than the
thread switch itself: on this 2-core KVM guest (cpuidle's haltpoll driver, guest_halt_poll_ns 0), a verify call
against a worker that sleeps for its compute cost 1.8 ms beyond it, 1.0 ms with the CPUs kept awake.

So a process that has done work within `linger_s` keeps each CPU it may run on busy with a spinner: a child
process at SCHED_IDLE priority, pinned to that CPU, that runs only while nothing else wants the CPU and yields it at
once to any thread that wakes there. A thread that wakes finds its CPU running, not halted. Once the process has
been idle for `linger_s`, the spinners sleep (a check every IDLE_CHECK_S), so an idle service burns no CPU.
vLLM (VLLM_SLEEP_WHEN_IDLE) and SGLang (--sleep-on-idle) keep a core polling the same way unless told otherwise.

    awake = KeepAwake(1.0)         # spinners for the CPUs of os.sched_getaffinity(0)
    awake.touch()                  # on each call, round or request: "busy now"
    awake.close()                  # the spinners end (also on their own once this process is gone)

    awake.linger_s = 0             # at once, the spinners sleep until it is set again (benchmarks.keep_awake)

The spinners read the time of the last touch and linger_s from two shared doubles (an unlinked file all map), so a
touch is a store, with no system call. `python engine/keep_awake.py FD CPU PARENT` is a spinner's entry point.
"""
from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys
import tempfile
import time

IDLE_CHECK_S = 0.05       # how often an idle spinner checks for work (and for its parent being gone)
SPINNER = os.path.abspath(__file__)   # this file, run as a spinner's program
SHARED = struct.Struct("dd")   # time.monotonic() of the last touch (CLOCK_MONOTONIC: one clock for all processes),
                               # then linger_s
TOUCHED_AT, LINGER_AT, DOUBLE = 0, 8, struct.Struct("d")      # their offsets in it


def supported() -> bool:
    """Spinners need CPU pinning and the SCHED_IDLE policy (Linux)."""
    return hasattr(os, "sched_setaffinity") and hasattr(os, "SCHED_IDLE")


class KeepAwake:
    """Spinners keeping `cpus` (by default those this process may run on) awake while this process is busy."""

    def __init__(self, linger_s: float, cpus: list[int] | None = None):
        self._linger_s = linger_s
        self._file = self._shared = None
        self._spinners: list[subprocess.Popen] = []
        if linger_s <= 0 or not supported():
            return
        self._file = tempfile.TemporaryFile()            # unlinked at once: nothing is left behind, ever
        self._file.truncate(SHARED.size)
        self._shared = mmap.mmap(self._file.fileno(), SHARED.size)
        SHARED.pack_into(self._shared, 0, -linger_s, linger_s)    # idle until the first touch
        fd = self._file.fileno()
        self._spinners = [subprocess.Popen([sys.executable, "-I", SPINNER, str(fd), str(cpu), str(os.getpid())],
                                           pass_fds=(fd,), stdin=subprocess.DEVNULL)
                          for cpu in sorted(cpus if cpus is not None else os.sched_getaffinity(0))]

    @property
    def linger_s(self) -> float:
        return self._linger_s

    @linger_s.setter
    def linger_s(self, seconds: float) -> None:
        """A new linger for the spinners there are (none if started at 0): 0 puts them to sleep at once."""
        self._linger_s = seconds
        if self._shared is not None:
            DOUBLE.pack_into(self._shared, LINGER_AT, seconds)

    @property
    def pids(self) -> list[int]:
        return [spinner.pid for spinner in self._spinners]

    def touch(self) -> None:
        """This process is busy now: its spinners keep spinning for linger_s from here."""
        if self._shared is not None:
            DOUBLE.pack_into(self._shared, TOUCHED_AT, time.monotonic())

    def close(self) -> None:
        for spinner in self._spinners:
            spinner.kill()
        for spinner in self._spinners:
            spinner.wait()
        self._spinners = []
        if self._shared is not None:
            self._shared.close()
            self._file.close()
            self._shared = self._file = None


def spin(fd: int, cpu: int, parent: int) -> None:
    """A spinner: at the lowest priority, on `cpu` alone, busy while the last touch is under linger_s old; else it
    sleeps, and ends once `parent` is gone."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    os.sched_setaffinity(0, {cpu})
    shared = mmap.mmap(fd, SHARED.size, access=mmap.ACCESS_READ)
    clock, read = time.monotonic, SHARED.unpack_from
    while True:
        while clock() - (touched := read(shared))[0] < touched[1]:
            pass
        if os.getppid() != parent:
            return
        time.sleep(IDLE_CHECK_S)


if __name__ == "__main__":
    spin(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
