"""IterationClock: the window between two complete records, split into named parts; numbers from a fake clock."""
import pytest

from rlhf_engine.trainer import clock as clock_mod
from rlhf_engine.trainer.clock import IterationClock


@pytest.fixture
def fake_time(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(clock_mod.time, "perf_counter", lambda: now[0])
    return now


def phases(gen, exp, train, ev=0.0):
    return {"time/generate": gen, "time/experience": exp, "time/train": train, "time/eval": ev}


def test_the_first_record_has_no_window_and_the_carried_parts_land_in_the_next(fake_time):
    c = IterationClock()
    first = c.close(phases(1.0, 0.5, 2.0), metrics=0.25)
    assert first == {"time/metrics": 0.25, "time/log": 0.0, "time/checkpoint": 0.0}  # no time/iteration, no other
    with c.timed("log"):  # writing record 0 and its log line
        fake_time[0] += 0.5
    with c.timed("checkpoint"):  # the checkpointer's turn after iteration 0
        fake_time[0] += 1.5
    with c.timed("log"):
        fake_time[0] += 0.25
    fake_time[0] += 4.0 + 0.125  # step 1: its phases (4.0) and 0.125 s that nothing names
    second = c.close(phases(1.5, 0.5, 1.75, ev=0.25), metrics=0.0)
    assert second["time/log"] == 0.75 and second["time/checkpoint"] == 1.5
    assert second["time/iteration"] == 0.5 + 1.5 + 0.25 + 4.125
    assert second["time/other"] == pytest.approx(0.125, abs=1e-12)
    third = c.close(phases(0.0, 0.0, 0.0), metrics=0.0)  # nothing happened since: an empty window
    assert third["time/log"] == third["time/checkpoint"] == third["time/iteration"] == 0.0


def test_unnamed_time_shows_up_as_other_not_as_a_phase(fake_time):
    """Negative control: a window whose phases cover only part of it reports the rest as other."""
    c = IterationClock()
    c.close(phases(0, 0, 0), metrics=0)
    fake_time[0] += 10.0
    rec = c.close(phases(2.0, 1.0, 3.0), metrics=1.0)
    assert rec["time/iteration"] == 10.0 and rec["time/other"] == pytest.approx(3.0)
