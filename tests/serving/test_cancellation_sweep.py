"""The response thread's cancellation sweep (serving/cancellation.py): each in-flight request is asked at least
once per period of wall time, the longest unasked first, however far apart the sweeps are."""

from pagedllm.serving.cancellation import due_for_asking

PERIOD = 0.2


def simulate(n: int, sweep_gaps: list[float]) -> dict[int, list[float]]:
    """Sweeps `sweep_gaps` apart over n requests registered at 0: when each request was asked."""
    last = {i: 0.0 for i in range(n)}
    asked: dict[int, list[float]] = {i: [] for i in range(n)}
    now = 0.0
    for gap in sweep_gaps:
        now += gap
        for key in due_for_asking(last, gap, PERIOD):
            last[key] = now
            asked[key].append(now)
    return asked


def test_a_sweep_asks_its_share_of_the_period_oldest_first():
    last = {"a": 5.0, "b": 1.0, "c": 3.0, "d": 2.0}
    assert due_for_asking(last, 0.1, PERIOD) == ["b", "d"]  # half the period: half of them
    assert due_for_asking(last, 0.02, PERIOD) == ["b"]  # a tenth, rounded up
    assert due_for_asking(last, 0.5, PERIOD) == ["b", "d", "c", "a"]  # a late sweep asks everyone
    assert due_for_asking({}, 0.1, PERIOD) == []


def test_every_request_is_asked_within_a_period_of_wall_time_at_any_sweep_spacing():
    for gaps in ([0.02] * 100, [0.15] * 20, [0.02, 0.02, 0.3, 0.05, 0.02, 0.11] * 10):
        asked = simulate(100, gaps)
        end = sum(gaps)
        for times in asked.values():
            marks = [0.0] + times + [end]
            # between two asks (or registration and the first ask), never much more than a period
            assert max(b - a for a, b in zip(marks, marks[1:])) <= PERIOD + max(gaps), gaps


def test_late_sweeps_still_ask_everyone_within_the_period():
    """Sweeps 100 ms apart (a busy response thread): a fixed tenth per sweep would take a second to ask 100
    requests; the time-based share asks all of them within the period."""
    asked = simulate(100, [0.1] * 10)
    assert all(times and times[0] <= 0.2 for times in asked.values())
