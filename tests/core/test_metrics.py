"""posttrain.core.metrics.read_metrics on files that a running, killed or damaged job leaves."""

from __future__ import annotations

import pytest

from posttrain.core import read_metrics
from posttrain.notebook import plot_metrics


def test_a_partly_written_last_line_is_left_out(tmp_path):
    """What a running (or killed) job leaves: two rows and half of a third."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo'
    )
    assert read_metrics(tmp_path)["step"].tolist() == [1, 2]
    assert plot_metrics(tmp_path, ["loss"]).axes[0].get_title() == "loss (nats/token)"


def test_a_corrupt_line_before_the_last_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(ValueError, match=rf"{path}:2 is not a JSON row"):
        read_metrics(path)
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is a JSON list"):
        read_metrics(path)
