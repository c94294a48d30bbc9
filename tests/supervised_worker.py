"""A recipe run as `python tests/supervised_worker.py WHAT`, supervised as every recipe is (tests/test_supervise.py).

WHAT: `ok` returns 0; `error` raises a TemperError; `bug` raises a ValueError; `interrupt` raises
KeyboardInterrupt; `native-exit` ends with `os._exit(1)` (how Ray's core ends a driver); `error-then-native-exit`
raises a TemperError and then ends with `os._exit(1)` at interpreter exit (Ray's teardown doing so); `sigkill`
kills itself; `env` prints its pid and whether the supervisor's variable reached it; `wait-sigterm` prints its
pid and then `stopped` once SIGTERM arrives."""

import atexit
import os
import signal
import sys
import time

from core.cli import run_recipe
from core.errors import TemperError
from core.supervise import CHILD_ENV


def main(argv: list[str]) -> int:
    what = argv[0]
    if what == "error":
        raise TemperError("the config's key x is wrong")
    if what == "bug":
        raise ValueError("a bug")
    if what == "interrupt":
        raise KeyboardInterrupt
    if what == "native-exit":
        os._exit(1)
    if what == "error-then-native-exit":
        atexit.register(os._exit, 1)
        raise TemperError("the trainer actor is unavailable")
    if what == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "env":
        print(os.getpid(), CHILD_ENV in os.environ, flush=True)
    if what == "wait-sigterm":
        stopped = []
        signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
        print(os.getpid(), flush=True)
        while not stopped:
            time.sleep(0.01)
        print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_recipe(main, sys.argv[1:], __doc__, None, "supervised_worker", supervise=True))
