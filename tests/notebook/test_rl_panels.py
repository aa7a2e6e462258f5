"""The dashboard's step time split panel (posttrain.notebook.rl_panels) with the weight sync of a
rollout engine apart from the policy: `weight_sync_s` is a part of `time_scoring_s`
(posttrain.rl.step_timing), so the panel stacks it apart and scoring less it, and the bars
still add up to the step's seconds."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from posttrain.notebook.rl_panels import _draw_time_split

ROWS = {
    "step": [1, 2],
    "time_rollout_s": [1.0, 1.0],
    "time_scoring_s": [0.5, 0.8],
    "time_logprobs_s": [0.1, 0.1],
    "time_update_s": [0.2, 0.2],
    "time_other_s": [0.0, 0.05],
}


def bars(frame: pd.DataFrame) -> dict[str, list[float]]:
    ax = Figure().add_subplot()
    _draw_time_split(ax, frame)
    return {c.get_label(): [round(float(b.get_height()), 6) for b in c] for c in ax.containers}


def test_the_weight_sync_is_stacked_apart_from_scoring():
    drawn = bars(pd.DataFrame({**ROWS, "weight_sync_s": [0.0, 0.3]}))
    assert list(drawn)[:3] == ["weight_sync", "rollout", "scoring"]
    assert drawn["weight_sync"] == [0.0, 0.3]
    assert drawn["scoring"] == [0.5, 0.5]  # 0.8 - 0.3 by hand
    totals = [sum(v[i] for v in drawn.values()) for i in range(2)]
    assert totals == [1.8, 2.15]  # the rows' five time columns summed by hand


def test_without_a_sync_the_panel_is_the_five_phases():
    for frame in (pd.DataFrame(ROWS), pd.DataFrame({**ROWS, "weight_sync_s": [0.0, 0.0]})):
        drawn = bars(frame)
        assert list(drawn) == ["rollout", "scoring", "logprobs", "update", "other"]
        assert drawn["scoring"] == [0.5, 0.8]
