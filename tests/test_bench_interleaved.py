"""bench/interleaved.py: sides alternate round by round, the warm-up round is left out, the peer protocol."""

from __future__ import annotations

import statistics
import sys
import textwrap

import numpy as np
import pytest

from bench.interleaved import PeerStepper, interleave


def test_interleave_alternates_and_drops_the_warm_up_round():
    calls: list[tuple[str, int]] = []
    a_times = [9.0, 1.0, 2.0, 4.0, 3.0]  # round 0 is the warm-up: its 9 s must not count
    b_times = [1.0, 2.0, 2.0, 2.0, 10.0]

    def side(name, times):
        def step(i):
            calls.append((name, i))
            return times[i]

        return step

    result = interleave(4, side("a", a_times), side("b", b_times))
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("b", 3), ("a", 3), ("a", 4), ("b", 4)]
    assert result.a_s == a_times[1:] and result.b_s == b_times[1:]
    ratios = np.array(a_times[1:]) / np.array(b_times[1:])
    assert result.median_ratio == pytest.approx(float(np.median(ratios)))
    # The median of ratios is not the ratio of medians: a drift that hits one round on both sides cancels.
    assert result.median_ratio != pytest.approx(statistics.median(a_times[1:]) / statistics.median(b_times[1:]))
    summary = result.summary()
    assert summary["a_median_s"] == statistics.median(a_times[1:])
    assert summary["ratios"] == pytest.approx(list(ratios))


PEER = textwrap.dedent(
    """
    import json, sys
    print("a library's chatter on stdout", flush=True)
    for line in sys.stdin:
        rows = json.loads(line)
        if rows == [-1]:
            sys.exit(3)
        print("more chatter", flush=True)
        print(json.dumps({"seconds": sum(rows) / 10}), flush=True)
    """
)


def test_peer_stepper_sends_rows_and_reads_the_answer_past_other_output(tmp_path):
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    with PeerStepper([sys.executable, str(script)], env={}) as peer:
        assert peer.step([1, 2, 3]) == pytest.approx(0.6)
        assert peer.step(np.array([5])) == pytest.approx(0.5)  # numpy indices are sent as ints
    assert peer.proc.returncode == 0  # closing stdin ends the peer


def test_peer_stepper_names_a_peer_that_exits_before_answering(tmp_path):
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    with (
        PeerStepper([sys.executable, str(script)], env={}) as peer,
        pytest.raises(RuntimeError, match=r"exited with 3"),
    ):
        peer.step([-1])
