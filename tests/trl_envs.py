"""Environment classes in the shape TRL's `GRPOTrainer(environment_factory=...)` documents: no base class, a
`reset(**kwargs) -> str | None`, public methods as tools, an optional `get_reward()`. Nothing here imports Temper."""

from __future__ import annotations


class Counter:
    """A counter the model raises with a tool; the reward: whether it reached the row's target."""

    def reset(self, **kwargs) -> str | None:
        self.total = 0
        self.target = int(kwargs.get("target", 10))
        return f" Reach {self.target}."

    def increment(self, step: int) -> str:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.total += step
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total == self.target)


class Calculator:
    """The calculator as a TRL environment (no reward of its own: the run's reward functions score the answer)."""

    def reset(self, **kwargs) -> str | None:
        self.calls = 0
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. "2 + 3".
        """
        from rollout.calculator import calculator

        self.calls += 1
        return str(calculator(expression))


class Unpicklable:
    def reset(self, **kwargs) -> str | None:
        self.handle = open(__file__)  # noqa: SIM115 - an open file does not pickle
        return None

    def read(self) -> str:
        """Read the next line.

        Returns:
            The line.
        """
        return self.handle.readline()


class Walker:
    """A TRL class with a tool named `step` (Temper's environments have a step(state, turn) of their own)."""

    def reset(self, **kwargs) -> str | None:
        self.position = 0
        return None

    def step(self, n: int) -> str:
        """Walk forward.

        Args:
            n: How many steps.
        """
        self.position += n
        return str(self.position)


class CountingCalculator(Calculator):
    """The calculator whose reward is the calls the episode made before it answered (episodes that differ)."""

    def get_reward(self) -> float:
        return float(self.calls)


class AsyncCounter:
    """Counter with a coroutine tool and a coroutine reward (TRL allows both: an LLM judge's reward, say). Like a client
    bound to the event loop it was made on, its tool fails when a later call runs on another loop than the first."""

    def reset(self, **kwargs) -> str | None:
        self.total, self.loop = 0, None
        return None

    async def increment(self, step: int) -> str:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        import asyncio

        self.loop = self.loop or asyncio.get_running_loop()
        if asyncio.get_running_loop() is not self.loop:
            raise RuntimeError("bound to a different event loop")
        self.total += step
        if step < 0:
            await asyncio.sleep(60)  # a call that hangs
        return str(self.total)

    async def get_reward(self) -> float:
        import asyncio

        await asyncio.sleep(0)
        return float(self.total)
