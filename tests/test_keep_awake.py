"""Keeping a busy process's CPUs awake (engine/keep_awake.py): one spinner per CPU, at SCHED_IDLE priority and pinned
to it, spinning only while its owner has been busy within linger_s, yielding its CPU to any other thread, and gone
once its owner is."""
import os
import signal
import subprocess
import sys
import time

import pytest

from engine.keep_awake import IDLE_CHECK_S, KeepAwake, supported

pytestmark = pytest.mark.skipif(not supported() or not os.path.exists("/proc/self/stat"),
                                reason="spinners need Linux (SCHED_IDLE, CPU pinning, /proc)")
TICK = 1 / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK


def cpu_over(pids: list[int], seconds: float) -> list[float]:
    before = [cpu_s(pid) for pid in pids]
    time.sleep(seconds)
    return [cpu_s(pid) - b for pid, b in zip(pids, before)]


def policy(pid: int) -> int:
    return os.sched_getscheduler(pid)


@pytest.fixture
def awake():
    keeper = KeepAwake(0.4)
    time.sleep(0.3)                                    # the spinners have started
    yield keeper
    keeper.close()


def test_one_spinner_per_cpu_of_the_process_each_pinned_to_its_cpu_at_sched_idle(awake):
    cpus = sorted(os.sched_getaffinity(0))
    assert len(awake.pids) == len(cpus)
    assert [os.sched_getaffinity(pid) for pid in awake.pids] == [{cpu} for cpu in cpus]
    assert all(policy(pid) == os.SCHED_IDLE for pid in awake.pids)


def test_spinners_spin_while_touched_and_sleep_once_the_owner_is_idle_for_linger(awake):
    assert max(cpu_over(awake.pids, 0.3)) <= 2 * TICK            # never touched: asleep
    awake.touch()
    assert min(cpu_over(awake.pids, 0.3)) >= 0.1                 # busy: each spins (well over a tick or two)
    time.sleep(awake.linger_s)
    assert max(cpu_over(awake.pids, 0.3)) <= 2 * TICK            # idle for linger_s: asleep again


def test_a_spinner_yields_its_cpu_to_a_thread_of_normal_priority(awake):
    cpu = sorted(os.sched_getaffinity(0))[0]
    busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        time.sleep(0.2)
        spinner = awake.pids[0]
        deadline = time.monotonic() + 1.0
        busy_s = spin_s = 0.0
        while time.monotonic() < deadline:                        # keep the spinner wanting the CPU throughout
            awake.touch()
            used = cpu_over([busy.pid, spinner], 0.1)
            busy_s, spin_s = busy_s + used[0], spin_s + used[1]
    finally:
        busy.kill()
        busy.wait()
    assert busy_s >= 0.5 and spin_s * 20 <= busy_s                # SCHED_IDLE gets ~0.3 %; at nice 0 it would be half


def test_close_ends_the_spinners():
    keeper = KeepAwake(0.4)
    pids = keeper.pids
    keeper.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    keeper.touch()                                                 # closed: a touch is harmless


def test_spinners_end_on_their_own_once_their_owner_is_killed():
    owner = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom engine.keep_awake import KeepAwake\n"
                              "k = KeepAwake(0.3)\nprint(*k.pids, flush=True)\nk.touch()\ntime.sleep(60)"],
                             stdout=subprocess.PIPE, text=True, cwd=os.getcwd(),
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    pids = [int(pid) for pid in owner.stdout.readline().split()]
    assert pids
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 0.3 + IDLE_CHECK_S + 5.0
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}") and "Z" not in state(pid)]
    assert not alive


def state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "Z"


def test_zero_turns_it_off():
    keeper = KeepAwake(0.0)
    assert keeper.pids == []
    keeper.touch()
    keeper.close()


def test_a_linger_set_to_zero_puts_spinning_spinners_to_sleep_at_once_and_a_new_one_wakes_them(awake):
    awake.touch()
    assert min(cpu_over(awake.pids, 0.2)) >= 0.05
    awake.linger_s = 0
    assert max(cpu_over(awake.pids, 0.3)) <= 2 * TICK
    awake.linger_s = 0.4
    awake.touch()
    assert min(cpu_over(awake.pids, 0.2)) >= 0.05
