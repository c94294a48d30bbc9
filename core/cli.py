"""What every recipe's command line shares: `--help`, `--debug`, and errors printed as one clear message.

    def main(argv): ...                                   # the recipe: CONFIG.yml [key=value ...]
    if __name__ == "__main__":
        sys.exit(run_recipe(main, sys.argv[1:], __doc__, DEFAULT_CONFIG, supervise=True))

With `supervise=True` the recipe runs in a child of the process the user started (`core.supervise`), so that
an ending Python never sees (Ray ending the driver, SIGKILL) is reported the same way.

A `core.errors.TemperError` (a bad config, YAML file, override, path, data
row or checkpoint; a run stopped on a non-finite loss or a dead trainer) is
printed to stderr as `error: <message>` and the process exits with code 2;
with `--debug` (or `TEMPER_DEBUG=1`) the traceback is raised as usual.
Anything else is a bug in Temper and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from core.errors import TemperError

EXIT_USER_ERROR = 2
DOCS = "docs/config.md"


def usage(module: str, doc: str, default_config: Path | None) -> str:
    """The recipe's docstring, how to call it, its default config and where its keys are documented."""
    lines = [f"usage: python -m {module} [CONFIG.yml] [key=value ...] [--debug]", "", doc.strip(), ""]
    if default_config is not None:
        lines.append(f"CONFIG.yml defaults to {default_config}.")
    lines += [
        f"Every key is documented in {DOCS}; overrides are dotted keys, e.g. train.steps=10.",
        "--debug (or TEMPER_DEBUG=1) shows the traceback of an error.",
    ]
    return "\n".join(lines)


def run_recipe(
    main: Callable[[list[str]], int],
    argv: list[str],
    doc: str | None,
    default_config: Path | None = None,
    module: str | None = None,
    supervise: bool = False,
) -> int:
    """A config recipe (`[CONFIG.yml] [key=value ...]`): `--help`, `--debug`, user errors without a traceback;
    `supervise` as in `run_cli`."""
    module = module or getattr(main, "__module__", "recipe")
    if any(a in ("-h", "--help") for a in argv):
        print(usage(str(module), doc or "", default_config))
        return 0
    unknown = [a for a in argv if a.startswith("--") and a != "--debug"]
    if unknown:
        print(
            f"error: unknown option {unknown[0]}\n{usage(str(module), '', default_config).splitlines()[0]}",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    return run_cli(main, argv, supervise)


def run_cli(main: Callable[[list[str]], int], argv: list[str], supervise: bool = False) -> int:
    """`main(argv)` with `--debug` taken out of argv and a `TemperError` printed as one line, exit code 2.

    With `supervise` (a recipe's `__main__`), it runs in a child process of this one, so that an ending Python
    never sees (Ray ending the driver, SIGKILL) still gets a message: `core.supervise`."""
    if supervise:
        from core.supervise import supervised

        return supervised(lambda: run_cli(main, argv))
    debug = "--debug" in argv or os.environ.get("TEMPER_DEBUG", "") not in ("", "0")
    try:
        return main([a for a in argv if a != "--debug"])
    except TemperError as err:
        if debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
