"""A recipe's process as a child of a small parent, so that an ending Python never sees still gets a message.

Some endings never reach Python, so nothing in the recipe's process can report them:
- Ray's core ends a driver whose node's raylet or object store went away (a lost head node) with `_exit(1)`,
  writing the reason only to its own log;
- the kernel's out-of-memory killer (or anyone) sends SIGKILL; native code crashes.
The user would see the process gone and nothing said. A training recipe run as `python -m recipes.X`
therefore runs in a child process, and the process the user started waits for it. When the recipe's Python
code is done (it returned, raised, or printed its `error: ...`), the child writes the exit code it chose to a
pipe; the parent exits with that code, whatever happens in the child's teardown after it. A child that
ended without writing one gets one line, `error: ...`, saying how it ended (quoting Ray's driver log when Ray
ended it) and how to resume, and exit code 2, like any other stopped run.

Signals: the parent passes SIGTERM and SIGHUP on to the child (an offline run's loop writes a checkpoint on
SIGTERM and exits). Ctrl-C's SIGINT reaches the child from the terminal, so the parent ignores its own copy:
send SIGTERM, not SIGINT, to the pid alone. On Linux the child dies with the parent (PR_SET_PDEATHSIG), so
`kill -9` of the pid a user sees still ends the run. `TEMPER_NO_SUPERVISE=1` runs the recipe in the process
itself (a profiler or debugger then sees it).
"""

from __future__ import annotations

import ctypes
import glob
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from core.cli import EXIT_USER_ERROR  # the code of a run stopped with one `error: ...` line

CHILD_ENV = "TEMPER_RECIPE_EXIT_FD"
OFF_ENV = "TEMPER_NO_SUPERVISE"
_PR_SET_PDEATHSIG = 1


def supervised(run: Callable[[], int]) -> int:
    """`run()`'s exit code, with `run` in a child process of this one (see the module's docstring)."""
    if os.environ.get(OFF_ENV, "") not in ("", "0"):
        return run()
    if CHILD_ENV in os.environ:
        return _run_as_child(run)
    return _run_parent()


def _run_as_child(run: Callable[[], int]) -> int:
    """In the child: `run()`, then its exit code to the parent's pipe. The variable is dropped first, so that no
    process this one starts (Ray's workers, a sub-recipe) takes itself for the child."""
    fd = int(os.environ.pop(CHILD_ENV))
    os.set_inheritable(fd, False)
    code = 1  # an exception escaping `run`: Python prints its traceback and exits with 1
    try:
        code = run()
        return code
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
        raise
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        raise
    finally:
        os.write(fd, bytes([code & 0xFF]))
        os.close(fd)


def _run_parent() -> int:
    """Run this command line (`sys.orig_argv`) again as a child and return the code it reports, or 2 with a
    message when it ended before reporting one."""
    child: subprocess.Popen | None = None
    pending: list[int] = []

    def forward(signum, _frame):
        if child is None:
            pending.append(signum)  # arrived before the child existed: delivered once it does
        else:
            child.send_signal(signum)

    # Installed before the child starts, so no signal falls in between; Python handlers do not survive exec.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    signal.signal(signal.SIGINT, lambda *_: None)  # the terminal sends Ctrl-C to the child as well

    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)  # a forked grandchild may hold the write end open after the child is gone
    started = time.time()
    child = subprocess.Popen(
        [sys.executable, *sys.orig_argv[1:]],
        env={**os.environ, CHILD_ENV: str(write_fd)},
        pass_fds=(write_fd,),
        preexec_fn=_die_with(os.getpid()),
    )
    os.close(write_fd)
    for early in pending:
        child.send_signal(early)
    rc = child.wait()
    try:
        reported = os.read(read_fd, 1)
    except BlockingIOError:
        reported = b""
    os.close(read_fd)
    if reported:
        return reported[0]
    print(f"error: {ending_message(child.pid, rc, started)}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def _die_with(parent: int) -> Callable[[], None] | None:
    """The child's step between fork and exec: SIGKILL when `parent` dies (Linux; elsewhere none)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the forked child

    def die_with_parent() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the call: nobody would be told
            os._exit(1)

    return die_with_parent


def ending_message(pid: int, rc: int, since: float = 0.0) -> str:
    """What ended the recipe's process `pid` (exit status `rc`, started at `since`) outside Python."""
    if rc < 0:
        name = signal.Signals(-rc).name
        how = f"was killed by {name}" + (" (the kernel's out-of-memory killer sends it, too)" if rc == -9 else "")
    else:
        said = ray_driver_last_warning(pid, since)
        how = f"ended with exit code {rc} before its Python code could report anything" + (
            f"; Ray's driver log last said: {said}"
            if said
            else "; Ray's core ends a driver so when its node's raylet or object store goes away"
        )
    return (
        f"the recipe's process (pid {pid}) {how}. Its work after the last checkpoint is lost: run the same "
        "command again to resume from that checkpoint."
    )


def ray_temp_dir() -> str:
    """Where Ray keeps its sessions unless `ray start --temp-dir` moved them (Ray's own order of variables)."""
    if "RAY_TMPDIR" in os.environ:
        root = os.environ["RAY_TMPDIR"]
    elif sys.platform.startswith("linux") and "TMPDIR" in os.environ:
        root = os.environ["TMPDIR"]
    else:
        root = "/tmp"
    return os.path.join(root, "ray")


def ray_driver_last_warning(pid: int, since: float = 0.0) -> str | None:
    """The last warning, error or fatal line of process `pid`'s Ray driver log written after `since` (a pid is
    reused: an older session's log is another process's), with the log's path."""
    pattern = os.path.join(ray_temp_dir(), "session_*", "logs", f"python-core-driver-*_{pid}.log")
    paths = {os.path.realpath(path) for path in glob.glob(pattern)}  # session_latest links to one of them
    logs = sorted(path for path in paths if os.path.getmtime(path) >= since)
    if not logs:
        return None
    with open(logs[-1], errors="replace") as f:
        lines = [line.strip() for line in f if line.startswith("[")]
    # `[2026-11-26 12:54:33,977 W 15010 15010] connection.cc:216: The connection ... Terminate the process.`
    serious = [line for line in lines if len(line.split()) > 2 and line.split()[2] in ("W", "E", "F")]
    if not serious:
        return None
    return f"{serious[-1].split('] ', 1)[-1]} ({logs[-1]})"
