"""A request in flight is the future of its rollouts, whichever kind they are (`posttrain.onpolicy.rollouts`): a
single turn renders each row's prompt into one batched request; a request run in the background is waited for
when a checkpoint stores it, and a restored one holds what was stored, episodes included."""

from __future__ import annotations

import threading
import time

from posttrain.config import RLConfig
from posttrain.onpolicy.prompts import PromptStream
from posttrain.onpolicy.rollouts import Rolled, SingleTurn
from posttrain.onpolicy.step import InFlight, done, restored_position, saved_position
from rollout.background import Background
from rollout.episodes import Episode
from rollout.sampler import Completion, SamplingParams

ROWS = [{"question": f"{i} + {i}", "answer": str(2 * i)} for i in range(6)]


def completion(text: str) -> Completion:
    return Completion([1, 2], [3, 4], [-0.5, -0.25], "stop", text)


class Recorder:
    """The samplers as a rollout sees them, recording what it was asked."""

    def __init__(self):
        self.asked: list[tuple[list, SamplingParams]] = []

    def generate(self, prompts, params):
        self.asked.append((list(prompts), params))
        return [completion(f"{p}#{j}") for p in prompts for j in range(params.n)]

    def turns(self, episodes):
        raise AssertionError("a single turn takes no turns")


def test_a_single_turn_is_one_request_of_the_rendered_prompts():
    params = SamplingParams(n=3, max_tokens=4, seed=7)
    for chat, first in [(False, "Q: 0 + 0"), (True, [{"role": "user", "content": "Q: 0 + 0"}])]:
        rl = RLConfig(prompt_template="Q: {question}", use_chat_template=chat)
        samplers = Recorder()
        rolled = SingleTurn(rl).run(ROWS[:2], params, samplers)
        assert len(samplers.asked) == 1  # one request: an engine shares each prompt's prefix among its n samples
        prompts, asked = samplers.asked[0]
        assert prompts[0] == first and asked is params
        assert [c.text for c in rolled.completions][:4] == [f"{prompts[0]}#0", f"{prompts[0]}#1", f"{prompts[0]}#2",
                                                            f"{prompts[1]}#0"]  # fmt: skip
        assert rolled.episodes is None
        assert SingleTurn(rl).rewards(rolled, None) is None  # the reward functions' alone


def test_a_checkpoint_waits_for_the_rollouts_in_flight_and_a_resumed_run_holds_them():
    stream = PromptStream(ROWS, 2, seed=0)
    first, second = next(stream), next(stream)
    release = threading.Event()

    def slow_episodes() -> Rolled:  # an async request still running when the checkpoint is taken
        release.wait(5)
        episode = Episode({"question": "x"}, prompt_ids=[1], token_ids=[5, 6], sampled=[True, False])
        episode.logprobs, episode.finish, episode.turns = [-0.1, 0.0], "done", 1
        return Rolled([episode.completion()], [episode])

    background = Background("rollouts")
    try:
        in_flight = [
            InFlight(first, done(Rolled([completion("a"), completion("b")]))),
            InFlight(second, background.submit(slow_episodes)),
        ]
        threading.Thread(target=lambda: (time.sleep(0.2), release.set()), daemon=True).start()
        meta = saved_position(4, stream, 9, in_flight)  # waits for the running request
    finally:
        background.close(5)
    assert in_flight[1].result.done()
    stream_after = next(stream)  # what follows the stored position; restoring rewinds the stream to it
    step, requests, restored = restored_position(meta, stream)
    assert (step, requests) == (4, 9) and next(stream).indices == stream_after.indices
    assert [r.prompts.indices for r in restored] == [first.indices, second.indices]
    assert [c.text for c in restored[0].rolled().completions] == ["a", "b"] and restored[0].rolled().episodes is None
    episode = restored[1].rolled().episodes[0]
    assert episode.sampled == [True, False] and episode.finish == "done" and episode.state is None
    assert restored[1].rolled().completions[0].sampled == [True, False]
