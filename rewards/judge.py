"""An LLM judge as a reward function: a model served by a vLLM engine on Ray reads each (prompt, completion) in a
template, answers, and a parser turns its verdict into a number.

    reward:
      functions:
        - fn: llm_judge
          kwargs:
            model: runs/judge/hf             # an HF directory (or Hub id) vLLM serves
            template: "Question: {prompt}\\nAnswer: {completion}\\nIs the answer correct? Say yes or no.\\n"
            parser: yes_no                   # number | yes_no | a regex with one group | package.module:function
            chat: true                       # the template as a user turn in the judge's chat template
            max_tokens: 32
            timeout_s: 120
            max_model_len: null              # the engine's context (default: the model's own)
            engine: {dtype: bfloat16, kv_cache_gib: 8}   # rollout.* keys for the judge's engine

The template is formatted with `prompt`, `completion` and the row's columns (`{answer}`); it must hold
`{completion}`. Parsers: `number` (the verdict's only number: one with none or several, "8/10", "7 out of 10",
fails), `yes_no` (1 for a verdict whose first word is yes, 0 for no; "Not sure" is neither), a regular expression
whose first group is a number, or a function `(verdict) -> float | None`. A verdict the parser cannot read fails
that completion; a call the engine does not answer within `timeout_s` (its start, once, may take up to
`START_TIMEOUT_S`, 600 s) fails every completion of that call, and the engine is stopped (a call that never came
back would hold it), the next batch starting a new one. A failed item is NaN: its group is dropped and counted in
`reward/<name>/failure_rate` and `reward/failed_groups`, as a raising reward function's, never a stand-in 0.

Unlike the other reward functions, which run in the reward workers, the judge runs in the run's own process
(`rewards.runner.RewardRunner` holds it): its engine is a Ray actor, started on the first batch it scores and
stopped with the runner, and decoding is greedy (temperature 0, seed 0) unless `temperature` is given.
`check` runs at config load: a template without `{completion}`, or a parser that is none of the above, is refused.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _only_number(verdict: str) -> float | None:
    """The verdict's one number; None where it has none or several ("8/10", "7 out of 10", "a scale of 1-5: 4" are
    ambiguous: a regex parser says which one is the score)."""
    found = NUMBER.findall(verdict)
    return float(found[0]) if len(found) == 1 else None


YES_NO = re.compile(r"\s*(yes|no)\b", re.IGNORECASE)


def _yes_no(verdict: str) -> float | None:
    """1 for a verdict whose first word is yes, 0 for no ("Not sure", "Nothing", "Yesterday" are neither)."""
    found = YES_NO.match(verdict)
    return None if found is None else 1.0 if found.group(1).lower() == "yes" else 0.0


def parser_of(spec: str) -> Callable[[str], float | None]:
    """The verdict parser `spec` names (module docstring); ValueError naming what is wrong."""
    if spec == "number":
        return _only_number
    if spec == "yes_no":
        return _yes_no
    if re.fullmatch(r"[\w.]+:\w+", spec):
        module, name = spec.split(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"kwargs.parser={spec!r}: {err}") from None
    try:
        pattern = re.compile(spec)
    except re.error as err:
        raise ValueError(f"kwargs.parser={spec!r}: not number, yes_no, a function or a regex ({err})") from None
    if pattern.groups < 1:
        raise ValueError(f"kwargs.parser={spec!r}: a regex needs a group around the number")

    def by_regex(verdict: str) -> float | None:
        found = pattern.search(verdict)
        try:
            return float(found.group(1)) if found else None
        except ValueError:
            return None

    return by_regex


def _read(parse: Callable[[str], float | None], verdict: str) -> float | None:
    """A parser's number, or None where it found none, raised, or gave something that is not a finite number."""
    try:
        value = parse(verdict)
        number = None if value is None else float(value)
    except (ValueError, TypeError, ArithmeticError):
        return None
    return number if number is not None and math.isfinite(number) else None


def _model_length(model: str) -> int:
    """The judge model's own context length (`max_position_embeddings`; 2048 where its config cannot be read)."""
    import json
    from pathlib import Path

    config = Path(model) / "config.json"
    if config.is_file():
        return int(json.loads(config.read_text()).get("max_position_embeddings") or 2048)
    return 2048


def check(kwargs: Mapping[str, Any]) -> None:
    """The judge's kwargs at config load (ValueError saying what is wrong)."""
    known = [name for name in inspect.signature(Judge.__init__).parameters if name != "self"]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise ValueError(f"unknown kwargs {', '.join(unknown)}; the judge takes {', '.join(known)}")
    if not isinstance(kwargs.get("model"), str):
        raise ValueError("kwargs.model: the judge's model (an HF directory or Hub id) is needed")
    template = kwargs.get("template")
    if not isinstance(template, str):
        raise ValueError("kwargs.template: the judge's prompt template is needed")
    fields = {name for _, name, _, _ in string.Formatter().parse(template) if name}
    if "completion" not in fields:
        raise ValueError(f"kwargs.template has no {{completion}} slot (it names {sorted(fields) or 'nothing'})")
    parser_of(str(kwargs.get("parser", "number")))
    from pydantic import ValidationError

    from rollout.config import RolloutConfig

    try:
        RolloutConfig.model_validate(dict(kwargs.get("engine") or {}))
    except ValidationError as err:
        raise ValueError(f"kwargs.engine (rollout.* keys of the judge's engine): {err}") from None


START_TIMEOUT_S = 600.0  # how long the judge's engine may take to start (its calls: kwargs.timeout_s)


class Judge:
    """The judge of one `reward.functions` entry (module docstring)."""

    def __init__(
        self,
        model: str,
        template: str,
        parser: str = "number",
        chat: bool = False,
        max_tokens: int = 32,
        timeout_s: float = 120.0,
        temperature: float = 0.0,
        max_model_len: int | None = None,
        engine: dict | None = None,
    ):
        check({"model": model, "template": template, "parser": parser, "engine": engine})
        self.model, self.template, self.chat = model, template, chat
        self.parse = parser_of(parser)
        self.max_tokens, self.timeout_s, self.temperature = max_tokens, timeout_s, temperature
        self.max_model_len = max_model_len or _model_length(model)
        self.engine_keys = dict(engine or {})  # rollout.* keys for the judge's engine (dtype, kv_cache_gib, ...)
        self._engine: Any = None

    def engine(self) -> Any:
        """The judge's vLLM engine, a Ray actor, started on first use."""
        if self._engine is None:
            from rollout.config import RolloutConfig
            from rollout.vllm_actor import RemoteVLLMSampler

            keys = {"max_model_len": self.max_model_len, "max_tokens": self.max_tokens, **self.engine_keys}
            cfg = RolloutConfig.model_validate({**keys, "sampler": "vllm"})
            # Starting an engine (loading, profiling, compiling) takes longer than a call may: its own limit.
            engine = RemoteVLLMSampler.start(self.model, cfg, seed=0, timeout_s=max(START_TIMEOUT_S, self.timeout_s))
            engine.timeout_s = self.timeout_s  # each call's limit
            self._engine = engine
        return self._engine

    def score(
        self, prompts: Sequence[str], completions: Sequence[str], columns: Mapping[str, Sequence]
    ) -> tuple[list[float | None], list[str]]:
        """Each completion's parsed verdict (None where it failed) and what failed."""
        from rollout.sampler import SamplingParams

        requests: list[Any] = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            row = {k: v[i] for k, v in columns.items()}
            try:
                text = self.template.format(**{**row, "prompt": prompt, "completion": completion})
            except (KeyError, IndexError, ValueError) as err:  # a slot the rows do not have: every item fails
                why = f"kwargs.template cannot be filled from the rows ({type(err).__name__}: {err}; columns: "
                return [None] * len(prompts), [why + f"{', '.join(sorted(columns)) or 'none'})"]
            requests.append([{"role": "user", "content": text}] if self.chat else text)
        params = SamplingParams(n=1, temperature=self.temperature, max_tokens=self.max_tokens, seed=0)
        try:
            verdicts = [c.text for c in self.engine().generate(requests, params)]
        except Exception as err:  # the engine failed or did not answer in time: every item of the call fails
            # A call that did not come back may still be running on the engine (it serves one call at a time), so
            # every later batch would queue behind it: the engine is stopped, and the next batch starts a new one.
            self.close()
            return [None] * len(requests), [f"the judge {self.model} did not answer: {type(err).__name__}: {err}"]
        values = [_read(self.parse, v) for v in verdicts]
        bad = [v for v, x in zip(verdicts, values, strict=True) if x is None]
        messages = [f"{len(bad)} verdicts the parser could not read (first: {bad[0][:80]!r})"] if bad else []
        return values, messages

    def close(self) -> None:
        """Stop the engine (a judge that never scored started none)."""
        if self._engine is not None:
            self._engine.stop()
            self._engine = None
