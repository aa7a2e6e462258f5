"""`posttrain.core.trackers`: names checked against the registry, and a tracker that raises is
counted and warned once while the others keep logging."""

from __future__ import annotations

import warnings

import pytest

from posttrain.core.trackers import TRACKERS, Trackers, flat_config


class Recorder:
    """A tracker that keeps what it was sent."""

    def __init__(self, run_dir, **options):
        self.calls: list[tuple] = []
        RECORDERS.append(self)

    def start(self, config, lineage):
        self.calls.append(("start", config, lineage))

    def log(self, metrics, step):
        self.calls.append(("log", metrics, step))

    def log_plots(self, paths):
        self.calls.append(("plots", [p.name for p in paths]))

    def finish(self):
        self.calls.append(("finish",))


class Raises(Recorder):
    """A tracker whose server is down: every log raises."""

    def log(self, metrics, step):
        raise ConnectionError("tracking server down")


RECORDERS: list[Recorder] = []


@pytest.fixture
def fake_trackers(monkeypatch):
    RECORDERS.clear()
    monkeypatch.setitem(TRACKERS, "recorder", Recorder)
    monkeypatch.setitem(TRACKERS, "raises", Raises)


def test_an_unknown_tracker_is_refused_with_the_allowed_names(tmp_path):
    with pytest.raises(ValueError, match=r"unknown tracker 'mlfow'; allowed: .*tensorboard.*wandb"):
        Trackers(["mlfow"], tmp_path)
    with pytest.raises(ValueError, match="twice"):
        Trackers(["tensorboard", "tensorboard"], tmp_path)


def test_a_raising_tracker_is_counted_and_warned_once_and_the_others_go_on(tmp_path, fake_trackers):
    (tmp_path / "loss.png").write_bytes(b"")  # only the name is sent to the fakes
    (tmp_path / "results.json").write_text("{}")
    t = Trackers(["raises", "recorder"], tmp_path)
    t.start({"optim": {"lr": 0.5}}, {"run_id": "r1"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2, 3):
            t.log({"step": step, "loss": 1.0 / step, "note": "text", "flag": True})
        t.finish(tmp_path)
    assert [str(w.message) for w in caught] == [
        "tracker 'raises' failed (ConnectionError: tracking server down); "
        "the run goes on without it"
    ]
    assert t.report() == {
        "raises": {"failures": 1, "error": "ConnectionError: tracking server down"},
        "recorder": {"failures": 0},
    }
    raising, recorder = RECORDERS
    assert raising.calls == [("start", {"optim": {"lr": 0.5}}, {"run_id": "r1"})]
    assert recorder.calls == [
        ("start", {"optim": {"lr": 0.5}}, {"run_id": "r1"}),
        ("log", {"loss": 1.0}, 1),
        ("log", {"loss": 0.5}, 2),
        ("log", {"loss": 1.0 / 3}, 3),
        ("plots", ["loss.png"]),
        ("finish",),
    ]
    t.finish(tmp_path)  # a second finish sends nothing
    assert len(recorder.calls) == 6


def test_a_tracker_that_fails_to_build_is_counted(tmp_path, monkeypatch):
    def missing(run_dir, **options):
        raise ImportError("No module named 'mlflow'")

    monkeypatch.setitem(TRACKERS, "missing", missing)
    with pytest.warns(RuntimeWarning, match="tracker 'missing' failed .ImportError"):
        t = Trackers(["missing"], tmp_path)
    t.start({}, {})
    t.log({"step": 1, "loss": 1.0})
    t.finish()
    assert t.report() == {
        "missing": {"failures": 1, "error": "ImportError: No module named 'mlflow'"}
    }


def test_flat_config_gives_the_dotted_cli_keys():
    assert flat_config({"optim": {"lr": 0.1, "steps": 2}, "seed": 0, "data": {}}) == {
        "optim.lr": 0.1,
        "optim.steps": 2,
        "seed": 0,
        "data": {},
    }
