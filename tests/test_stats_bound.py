"""A layer's per-step counters keep the latest KEEP_STEPS steps (each held a device array on
the accelerator paths: a long generation kept them all), and an undo or a trim's restore
still takes back exactly the steps it gave."""

import numpy as np

from tiered.runtime import stats


def test_counters_keep_the_latest_steps(monkeypatch):
    monkeypatch.setattr(stats, "KEEP_STEPS", 8)
    s = stats.LayerStats()
    for i in range(20):
        s.record_step(float(i), 100 + i, 0.5)
    assert s.decode_steps == 20
    assert list(s.selected) == [float(i) for i in range(12, 20)]
    got = s.summary()
    assert got["decode_steps"] == 20 and got["steps_summarized"] == 8
    assert got["selected_mean"] == np.mean(range(12, 20))
    s.selected.pop(), s.live.pop(), s.resident_mass.pop()  # what undo_step does
    assert list(s.live) == list(range(112, 119))
    s.record_step(7.0, 7, 0.25)  # and the bound holds after it
    assert len(s.selected) == 8 and s.selected[-1] == 7.0


def test_a_trim_checkpoint_puts_the_counters_back(monkeypatch):
    from tiered.layer.trim import put_back_stats

    monkeypatch.setattr(stats, "KEEP_STEPS", 4)
    s = stats.LayerStats()
    for i in range(6):
        s.record_step(float(i), i, 0.1)
    saved = (s.decode_steps, list(s.selected), list(s.live), list(s.resident_mass))
    for i in range(3):
        s.record_step(99.0, 99, 0.9)
    put_back_stats(s, saved)
    assert s.decode_steps == 6 and list(s.selected) == [2.0, 3.0, 4.0, 5.0]
    assert list(s.live) == [2, 3, 4, 5] and s.selected.maxlen == 4  # still bounded
