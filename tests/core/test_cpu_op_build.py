"""Loading the C++ op (``xmark_core.cpu_op.load``) never waits without a bound: a build lock that a
killed build left behind is removed, and a build another process holds is waited on for
``timeout_s`` at most. Each load runs in a process of its own (the op is loaded once per process)
on the machine's real build directory."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from xmark_core import cpu_op

_LOAD = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
from xmark_core import cpu_op
module = cpu_op.load({args})
print("LOADED" if module is not None else "NONE")
"""


def _load_in_a_process(args: str = "") -> tuple[str, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _LOAD.format(args=args)],
        capture_output=True,
        text=True,
        # 5x margin and more: a load of the built op takes about 5 s here, a build about 30 s; torch's
        # own wait on a stale lock never ends, so a hang is told apart
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, time.monotonic() - start


def test_a_build_lock_left_by_a_killed_build_is_removed() -> None:
    directory = cpu_op.build_directory(cpu_op.op_name())
    stale = os.path.join(directory, "lock")
    # plant torch's build lock as a killed build leaves it, while no process of ours builds here
    with cpu_op.build_turn(directory, timeout_s=300) as held:
        assert held
        with open(stale, "w"):
            pass
    output, _ = _load_in_a_process()
    assert "LOADED" in output, output
    assert "removed the build lock a stopped build" in output
    assert not os.path.exists(stale)


def test_a_build_another_process_holds_is_waited_on_with_a_bound() -> None:
    directory = cpu_op.build_directory(cpu_op.op_name())
    with cpu_op.build_turn(directory, timeout_s=300) as held:
        assert held
        output, elapsed = _load_in_a_process("timeout_s=1.0")
    assert "NONE" in output and "the compiled kernel serves" in output, output
    # the process waited its 1 s and gave up instead of waiting for the turn it never got (held here
    # until it ended). 5x margin and more: the process took 2.9 s here (torch's import, the 1 s
    # wait); waiting for the turn, it would have run into the 300 s bound of _load_in_a_process
    assert elapsed < 60
    # the turn is free again: the next process loads the op
    output, _ = _load_in_a_process()
    assert "LOADED" in output, output
