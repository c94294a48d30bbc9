"""The errors whose message says everything the user needs: recipes print them without a traceback.

    TemperError        a run stopped for a reason its message explains (`core.cli` prints it, exit code 2)
      UserError        a mistake in what the user gave: config, YAML, overrides, files, data, checkpoints
        ConfigError, MalformedRow, CheckpointMismatch, UnknownReward (defined next to their checks)

Set `TEMPER_DEBUG=1` or pass `--debug` to a recipe to see the traceback as well.
"""

from __future__ import annotations


class TemperError(Exception):
    """A run stopped for a reason its message explains in full (what, where, what to do)."""


class UserError(TemperError):
    """A mistake in what the user gave: a config key, a YAML file, an override, a path, a data row."""


class CheckpointMismatch(UserError, ValueError):
    """A checkpoint that does not fit the model it is being loaded into (names every differing tensor/key)."""


class MissingPath(UserError, FileNotFoundError):
    """A path the config names does not exist (the message names the key and the path)."""
