"""A recipe run as `python tests/supervised_worker.py WHAT`, supervised as every recipe is (tests/test_supervise.py).

WHAT: `ok` returns 0; `error` raises a TemperError; `bug` raises a ValueError; `native-exit` ends with
`os._exit(1)` (how Ray's core ends a driver); `sigkill` kills itself; `wait-sigterm` prints its pid and then
`stopped` once SIGTERM arrives."""

import os
import signal
import sys
import time

from core.cli import run_recipe
from core.errors import TemperError


def main(argv: list[str]) -> int:
    what = argv[0]
    if what == "error":
        raise TemperError("the config's key x is wrong")
    if what == "bug":
        raise ValueError("a bug")
    if what == "native-exit":
        os._exit(1)
    if what == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
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
