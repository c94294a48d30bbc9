"""A recipe's process as a child of a small parent, so that an ending Python never sees still gets a message.

Some endings never reach Python, so nothing in the recipe's process can report them:
- Ray's core ends a driver whose node's raylet or object store went away (a lost head node) with `_exit(1)`,
  writing the reason only to its own log;
- the kernel's out-of-memory killer (or anyone) sends SIGKILL; native code crashes.
The user would see the process gone and nothing said. `python -m recipes.X` therefore runs the recipe in a
child process and waits for it. The child writes one byte to a pipe from Python's exit handlers, which run on
every ending Python controls (success, a `TemperError`, a traceback), and never on the ones above. A child that
ended without that byte gets one line, `error: ...`, saying how it ended, what Ray's log says if Ray ended it,
and how to resume, and the parent exits with code 2, like any other stopped run.

The parent forwards SIGTERM and SIGHUP (a scheduler's "stop": the child checkpoints and exits); Ctrl-C's SIGINT
already reaches the child from the terminal. The child dies with the parent (PR_SET_PDEATHSIG on Linux), so
`kill -9` of the pid a user sees still ends the run.
"""

from __future__ import annotations

import atexit
import ctypes
import glob
import os
import signal
import subprocess
import sys

CHILD_ENV = "TEMPER_RECIPE_EXIT_FD"
PYTHON_EXIT = b"x"
_PR_SET_PDEATHSIG = 1


def is_child() -> bool:
    """Whether this process is a supervised recipe's child (then it runs the recipe itself)."""
    return CHILD_ENV in os.environ


def mark_python_exit() -> None:
    """In the child: write the exit byte when Python exits. The variable is dropped, so that recipes this one
    starts (the quickstart's stages) are supervised on their own, and the pipe is not inherited by them."""
    fd = int(os.environ.pop(CHILD_ENV))
    os.set_inheritable(fd, False)
    atexit.register(os.write, fd, PYTHON_EXIT)


def _die_with_parent() -> None:
    """In the forked child, before exec: SIGKILL when the parent dies (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def run_supervised() -> int:
    """Run this command line (`sys.orig_argv`) again as a child and return its exit code, or 2 with a message
    when it ended without Python's exit handlers."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)  # a forked grandchild may hold the write end open after the child is gone
    env = {**os.environ, CHILD_ENV: str(write_fd)}
    child = subprocess.Popen(
        [sys.executable, *sys.orig_argv[1:]], env=env, pass_fds=(write_fd,), preexec_fn=_die_with_parent
    )
    os.close(write_fd)

    def forward(signum, _frame):
        child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    signal.signal(signal.SIGINT, lambda *_: None)  # the terminal sends Ctrl-C to the child as well
    rc = child.wait()
    try:
        python_exit = os.read(read_fd, 1) == PYTHON_EXIT
    except BlockingIOError:
        python_exit = False
    os.close(read_fd)
    if python_exit:
        return rc
    print(f"error: {ending_message(child.pid, rc)}", file=sys.stderr, flush=True)
    return 2


def ending_message(pid: int, rc: int) -> str:
    """What ended the recipe's process `pid` (exit code `rc`) outside Python, and how to go on."""
    if rc < 0:
        name = signal.Signals(-rc).name
        how = f"was killed by {name}" + (" (the kernel's out-of-memory killer sends it, too)" if rc == -9 else "")
    else:
        how = f"ended with exit code {rc} without a Python error"
    said = ray_driver_last_warning(pid)
    why = (
        f"; Ray ended it: {said}"
        if said
        else ("; a Ray driver ends so when its node's raylet or object store goes away" if rc > 0 else "")
    )
    return (
        f"the recipe's process (pid {pid}) {how}{why}. Nothing after its last checkpoint is kept: run the same "
        "command again to resume from it."
    )


def ray_driver_last_warning(pid: int) -> str | None:
    """The last warning, error or fatal line of the Ray driver log of process `pid`, with its file, if any."""
    root = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), "ray")
    pattern = os.path.join(root, "session_*", "logs", f"python-core-driver-*_{pid}.log")
    logs = sorted({os.path.realpath(path) for path in glob.glob(pattern)})  # session_latest links to one of them
    if not logs:
        return None
    with open(logs[-1], errors="replace") as f:
        lines = [line.strip() for line in f if line.startswith("[")]
    # `[2026-11-26 12:54:33,977 W 15010 15010] connection.cc:216: The connection ... Terminate the process.`
    serious = [line for line in lines if len(line.split()) > 2 and line.split()[2] in ("W", "E", "F")]
    if not serious:
        return None
    return f"{serious[-1].split('] ', 1)[-1]} ({logs[-1]})"
