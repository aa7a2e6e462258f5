"""posttrain.notebook.dashboard: the live dashboard as a real trainer callback (text fallback and
forced widget mode), its throttling, and plot_metrics."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from _figure_helpers import pyplot_untouched
from matplotlib.figure import Figure

import posttrain.notebook.dashboard as dashboard
from posttrain.data import SFTDataset, SFTLoader
from posttrain.models import ByteTokenizer, build_model, get_preset
from posttrain.notebook import LiveDashboard, plot_metrics
from posttrain.rl import Group, Trajectory
from posttrain.train import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sft_trainer(callbacks=(), **kwargs) -> Trainer:
    """tiny-1m, byte tokenizer, 8 SFT rows, batch 4."""
    rows = [{"prompt": f"{i}+1?", "completion": str(i + 1)} for i in range(8)]
    loader = SFTLoader(SFTDataset(rows, ByteTokenizer(), max_seq_len=32), batch_size=4)
    model = build_model(get_preset("tiny-1m"), seed=0)
    return Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        data=loader,
        progress=False,
        callbacks=callbacks,
        **kwargs,
    )


class FakeTrainer:
    """Just what the dashboard reads: callbacks, metrics, progress."""

    def __init__(self):
        self.callbacks, self.rows, self.progress = [], [], True

    @property
    def metrics(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows)

    def fit(self, num_steps: int) -> None:
        while len(self.rows) < num_steps:
            step = len(self.rows) + 1
            row = {"step": step, "loss": 3.0 / step}
            self.rows.append(row)
            for callback in self.callbacks:
                callback(self, row)


@pytest.fixture
def displays(monkeypatch):
    shown = []
    monkeypatch.setattr(dashboard, "_display", shown.append)
    return shown


# ------------------------------------------------------------------ fallback (no kernel)


def test_plain_process_takes_the_text_fallback(capsys):
    dash = LiveDashboard()
    trainer = sft_trainer(callbacks=[dash])
    trainer.fit(3)
    assert dashboard.in_notebook() is False
    assert dash.mode == "text" and dash.widget is None and dash.renders == 0
    assert capsys.readouterr().out == ""  # nothing extra: the trainer's bar is the progress


def test_text_mode_log_every_prints_one_line_per_n_steps(capsys):
    trainer = FakeTrainer()
    LiveDashboard(widget=False, log_every=2, total=5).attach(trainer)
    trainer.fit(5)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines] == ["2/5", "4/5", "5/5"]  # every 2nd + final
    assert "loss 0.6" in lines[-1]


# ------------------------------------------------------------------ widget mode


def test_widget_state_after_fit_reflects_the_run(displays):
    dash = LiveDashboard(widget=True, total=3, min_interval_s=3600)
    images = []
    trainer = sft_trainer(callbacks=[dash, lambda t, row: images.append(bytes(dash.image.value))])
    trainer.fit(3)

    assert dash.mode == "widget" and dash.errors == []
    assert len(displays) == 1 and displays[0] is dash.widget and dash.displays == 1
    assert dash.progress.value == 3 and dash.progress.max == 3
    assert "step 3/3" in dash.header.value and "loss" in dash.header.value
    assert [len(i) > 0 and i.startswith(PNG_MAGIC) for i in images] == [True] * 3
    # Throttled: step 1 drawn at once, step 2 skipped (interval not over), step 3 = total.
    assert dash.renders == 2
    assert images[0] == images[1] != images[2]
    assert dash.table.value == ""  # SFT: no rollouts table
    assert "widget-hprogress" not in dash.header.value  # the bar is its own widget
    assert type(dash.progress).__name__ == "IntProgress"


def test_throttle_every_and_interval(displays):
    trainer = FakeTrainer()
    every_step = LiveDashboard(widget=True, min_interval_s=0).attach(trainer)
    every_2nd = LiveDashboard(widget=True, min_interval_s=0, every=2, total=5).attach(trainer)
    trainer.fit(5)
    assert every_step.renders == 5
    assert every_2nd.renders == 3  # steps 2, 4 and the final 5
    assert len(displays) == 2  # one per dashboard, never one per step
    assert trainer.progress is False  # attach in widget mode hands progress to the dashboard
    assert every_step.attach(trainer) is every_step and trainer.callbacks.count(every_step) == 1


def test_final_state_without_total_flush_and_trainer_target(displays):
    trainer = FakeTrainer()
    dash = LiveDashboard(widget=True, min_interval_s=3600).attach(trainer)
    trainer.fit(3)
    assert dash.renders == 1 and "step 1" in dash.header.value  # steps 2-3 pending
    dash.flush()
    assert dash.renders == 2 and "step 3" in dash.header.value and dash.progress.value == 3
    dash.flush()
    assert dash.renders == 2  # nothing new

    trainer = FakeTrainer()
    trainer.target_steps = 3  # the attribute the trainers' fit will set
    dash = LiveDashboard(widget=True, min_interval_s=3600).attach(trainer)
    trainer.fit(3)
    assert dash.renders == 2 and "step 3/3" in dash.header.value


def test_pending_state_is_drawn_when_the_notebook_cell_ends(displays, monkeypatch):
    class Events:
        def __init__(self):
            self.callbacks = []

        def register(self, name, fn):
            assert name == "post_run_cell"
            self.callbacks.append(fn)

        def unregister(self, name, fn):
            self.callbacks.remove(fn)

    shell = type("Shell", (), {"events": Events(), "kernel": object()})()
    monkeypatch.setattr(dashboard, "_ipython", lambda: shell)
    trainer = FakeTrainer()
    dash = LiveDashboard(widget=True, min_interval_s=3600).attach(trainer)
    trainer.fit(4)
    assert dash.renders == 1 and len(shell.events.callbacks) == 1  # registered once
    for fn in list(shell.events.callbacks):
        fn(None)  # IPython: the cell finished
    assert dash.renders == 2 and "step 4" in dash.header.value
    assert shell.events.callbacks == []


def test_a_failing_redraw_never_stops_training(displays, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no ink")

    monkeypatch.setattr(dashboard, "_draw", broken)
    trainer = FakeTrainer()
    dash = LiveDashboard(widget=True, min_interval_s=0).attach(trainer)
    trainer.fit(2)
    assert len(dash.errors) == 2 and "RuntimeError: no ink" in dash.errors[0]
    texts = [o["text"] for o in dash.out.outputs]  # written with append_stdout, not print
    assert all(o["name"] == "stdout" for o in dash.out.outputs) and "no ink" in texts[0]


# ------------------------------------------------------------------ RL rows


def rl_trainer(**kwargs):
    from posttrain.envs import chain_sum_task
    from posttrain.policy import Policy
    from posttrain.rl import RLAlgorithm, RLTrainer

    policy = Policy.from_spec("tiny-1m", seed=0)
    return RLTrainer(
        policy,
        torch.optim.AdamW(policy.model.parameters(), lr=1e-4),
        task=chain_sum_task(size=16, held_out_size=2),
        algo=RLAlgorithm.grpo(group_size=2, kl_coef=0.01),
        prompts_per_step=2,
        max_new_tokens=3,
        progress=False,
        **kwargs,
    )


def test_rl_rows_reward_kl_outcomes_and_rollout_table(displays):
    dash = LiveDashboard(widget=True, min_interval_s=0, total=2)
    trainer = rl_trainer(callbacks=[dash])
    trainer.fit(2)
    assert dash.errors == []
    assert dash._fig_metrics == ["loss", "reward_mean", "kl", "accuracy", "outcomes", "time_split"]
    titles = [ax.get_title() for ax in dash._fig.axes if ax.get_visible()]
    assert titles[:5] == [
        "loss (nats/token)",
        "reward (mean)",
        "KL to reference (nats/token)",
        "accuracy (fraction ok)",
        "outcomes (trajectories per step)",
    ]
    assert titles[5].startswith("step time split (s), MFU ")
    assert "step 2/2" in dash.header.value and "reward_mean" in dash.header.value

    # The rollout table comes from trainer.last_groups (+ last_builders for the question).
    item = {"question": "3 + 4 = ?", "answer": "7"}
    t = dict(group_id=0, prompt_ids=[1], logprobs=[-0.5], finish_reason="stop", policy_version=2)
    trainer.last_groups = [
        Group(
            [
                Trajectory(**t, completion_ids=[55], reward=1.0, outcome="ok", text="7"),
                Trajectory(**t, completion_ids=[56], reward=0.0, outcome="wrong", text="<b>8</b>"),
            ]
        )
    ]
    trainer.last_builders = [type("B", (), {"item": item})()]
    dash.render()
    table = dash.table.value
    assert "3 + 4 = ?" in table and "&lt;b&gt;8&lt;/b&gt;" in table  # escaped
    assert table.count("<tr>") == 3 and ">ok<" in table and ">wrong<" in table


# ------------------------------------------------------------------ plot_metrics


def test_plot_metrics_from_a_run_folder(tmp_path):
    sft_trainer(run_dir=tmp_path / "run").fit(3)
    with pyplot_untouched():
        fig = plot_metrics(tmp_path / "run", ["loss", "lr"])
    assert isinstance(fig, Figure)
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["loss (nats/token)", "learning rate"]
    assert visible[0].get_xlabel() == "step"
    assert list(visible[0].lines[0].get_xdata()) == [1, 2, 3]
    assert fig._repr_png_().startswith(PNG_MAGIC)  # displays once in a notebook, no pyplot
    with pytest.raises(ValueError, match=r"no column \['reward'\].*available: .*'loss'"):
        plot_metrics(tmp_path / "run", ["reward"])
    with pytest.raises(FileNotFoundError):
        plot_metrics(tmp_path / "nothing")


def test_plot_metrics_smoothing_and_rl_defaults():
    """EMA weight 0.5, debiased, on [2.0, 1.5, 1.2]: 2.0; (1.5 + 0.5*2)/1.5 = 1.6667;
    (1.2 + 0.5*1.5 + 0.25*2)/1.75 = 1.4."""
    frame = pd.DataFrame({"step": [1, 2, 3], "loss": [2.0, 1.5, 1.2]})
    raw, smoothed = plot_metrics(frame, ["loss"], smooth=0.5).axes[0].lines
    assert list(raw.get_ydata()) == [2.0, 1.5, 1.2]
    assert list(smoothed.get_ydata()) == pytest.approx([2.0, 2.5 / 1.5, 1.4])

    rl = pd.DataFrame(
        {
            "step": [1, 2],
            "loss": [0.1, 0.2],
            "reward_mean": [0.0, 0.5],
            "accuracy": [0.0, 0.5],
            "outcome_ok": [0, 2],
            "outcome_wrong": [4, 2],
            "eval/accuracy": [float("nan"), 0.25],
        }
    )
    fig = plot_metrics(rl)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == [
        "loss (nats/token)",
        "reward (mean)",
        "accuracy (fraction ok)",
        "outcomes (trajectories per step)",
        "held-out accuracy",
    ]
    outcomes = [ax for ax in fig.axes if ax.get_title().startswith("outcomes")][0]
    assert [p.get_height() for p in outcomes.patches] == [0, 2, 4, 2]  # ok bars, wrong bars
    held_out = fig.axes[4]
    assert list(held_out.lines[0].get_xdata()) == [2]  # NaN rows skipped
    with pytest.raises(ValueError, match="smooth"):
        plot_metrics(frame, smooth=1.0)


# ------------------------------------------------------------------ bad input: reported, not raised


@pytest.mark.parametrize("widget", [False, True])
def test_an_unknown_metric_is_reported_once_naming_the_columns(widget, displays):
    trainer = FakeTrainer()
    dash = LiveDashboard(["lose", "eval/loss"], widget=widget, min_interval_s=0).attach(trainer)
    if widget:
        trainer.fit(3)
    else:
        with pytest.warns(UserWarning, match=r"no column \['lose'\].*available: \['loss'\]"):
            trainer.fit(3)
    assert (
        len(dash.errors) == 1 and "'lose'" in dash.errors[0] and "eval/loss" not in dash.errors[0]
    )


@pytest.mark.parametrize("widget", [False, True])
def test_a_row_whose_step_is_not_a_number_is_an_error_not_a_crash(widget, displays):
    dash = LiveDashboard(widget=widget, min_interval_s=0)
    with pytest.warns(UserWarning, match="step='abc'"):
        dash(FakeTrainer(), {"step": "abc", "loss": 1.0})
    assert dash.errors == ["dashboard: a row with step='abc' (not a number) was not shown"]


def test_sft_rows_get_a_throughput_panel_with_the_last_mfu():
    frame = pd.DataFrame(
        {
            "step": [1, 2, 3],
            "loss": [3.0, 2.5, 2.0],
            "tokens_per_s": [900.0, 1000.0, 1100.0],
            "mfu": [0.01, 0.012, 0.015],
        }
    )
    fig = plot_metrics(frame)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["loss (nats/token)", "throughput (tokens/s), MFU 1.50%"]
    assert list(fig.axes[1].lines[0].get_ydata()) == [900.0, 1000.0, 1100.0]
    no_mfu = plot_metrics(frame.drop(columns=["mfu"]))
    assert [ax.get_title() for ax in no_mfu.axes if ax.get_visible()][1] == "throughput (tokens/s)"


# ------------------------------------------------------------------ pace: elapsed, ETA, tokens/s


def test_run_pace_elapsed_eta_and_tokens_per_s_by_hand():
    """SFT rows (tokens_per_s = trained tokens per second), one without a step time. Window 3
    = the last three timed rows (steps 2, 4, 5: 1 s, 1 s, 2 s). ETA to step 11 = 6 steps x 4/3 s
    = 8 s; trained tokens/s = (100 x 1 + 200 x 1 + 50 x 2) / 4 s = 100; elapsed without a
    measured clock = 4 + 1 + 1 + 2 = 8 s."""
    from posttrain.notebook.run_pace import run_pace

    nan = float("nan")
    sft = pd.DataFrame(
        {
            "step": [1, 2, 3, 4, 5],
            "step_time_s": [4.0, 1.0, nan, 1.0, 2.0],
            "tokens_per_s": [10.0, 100.0, nan, 200.0, 50.0],
        }
    )
    pace = run_pace(sft, total=11, window=3)
    assert (pace.step, pace.elapsed_s, pace.eta_s) == (5, 8.0, pytest.approx(8.0))
    assert pace.trained_tokens_per_s == pytest.approx(100.0)
    assert pace.sampled_tokens_per_s is None  # SFT rows log no other token count
    assert run_pace(sft, total=3, elapsed_s=30.0).elapsed_s == 30.0
    assert run_pace(sft, total=3).eta_s == 0.0  # past the last step
    assert run_pace(sft).eta_s is None  # no total
    # With the rows' arrival timed, the pace is wall clock per step: rows of steps 3, 4, 5
    # arrived at 10, 13 and 19 s -> (19 - 10) / 2 = 4.5 s a step, ETA 6 x 4.5 = 27 s; window 1
    # keeps the last interval: 6 s a step, 36 s
    clock = [(1, 0.0), (3, 10.0), (4, 13.0), (5, 19.0)]
    assert run_pace(sft, total=11, step_clock=clock, window=2).eta_s == pytest.approx(27.0)
    assert run_pace(sft, total=11, step_clock=clock, window=1).eta_s == pytest.approx(36.0)

    # RL rows: tokens_per_s = sampled, trained_tokens_per_s = trained, over 2 s + 3 s:
    # sampled (300 x 2 + 100 x 3) / 5 = 180, trained (50 x 2 + 10 x 3) / 5 = 26
    rl = pd.DataFrame(
        {
            "step": [1, 2],
            "step_time_s": [2.0, 3.0],
            "tokens_per_s": [300.0, 100.0],
            "trained_tokens_per_s": [50.0, 10.0],
        }
    )
    pace = run_pace(rl, total=4)
    assert pace.sampled_tokens_per_s == pytest.approx(180.0)
    assert pace.trained_tokens_per_s == pytest.approx(26.0)
    assert pace.eta_s == pytest.approx(2 * 2.5)
    bare = run_pace(pd.DataFrame({"step": [1], "loss": [2.0]}), total=4)
    assert (bare.elapsed_s, bare.eta_s, bare.trained_tokens_per_s) == (None, None, None)
    for bad, match in (({"window": 0}, "window=0"), ({"elapsed_s": -1.0}, "elapsed_s=-1.0")):
        with pytest.raises(ValueError, match=match):
            run_pace(sft, **bad)


class PacedTrainer(FakeTrainer):
    """Rows with a 2 s step time and 1,500 trained tokens/s; the clock advances 3 s a step."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def fit(self, num_steps: int) -> None:
        while len(self.rows) < num_steps:
            self.clock["now"] += 3.0
            step = len(self.rows) + 1
            row = {"step": step, "loss": 3.0 / step, "step_time_s": 2.0, "tokens_per_s": 1500.0}
            self.rows.append(row)
            for callback in self.callbacks:
                callback(self, row)


def test_header_and_log_line_show_elapsed_eta_and_tokens_per_s(displays, monkeypatch, capsys):
    """Steps end at t = 103, 106, 109 s; the first began at 103 - 2 = 101 s, so at step 3
    elapsed = 8 s; ETA at the wall-clock pace (3 s a step, not the 2 s of step time) =
    (10 - 3) x 3 s = 21 s; trained tokens/s 1,500 -> '1.5k'."""
    clock = {"now": 100.0}
    monkeypatch.setattr(dashboard, "time", type("Clock", (), {"monotonic": lambda: clock["now"]}))
    trainer = PacedTrainer(clock)
    dash = LiveDashboard(["loss"], widget=True, total=10, every=3, min_interval_s=0)
    dash.attach(trainer)
    trainer.fit(3)
    assert dash.renders == 1 and dash.header.value == (
        "<b>training</b> &middot; step 3/10 &middot; elapsed 0:08 &middot; ETA 0:21 &middot; "
        "trained 1.5k tok/s &middot; loss 1"
    )
    clock["now"] = 100.0
    trainer = PacedTrainer(clock)
    LiveDashboard(["loss"], widget=False, total=10, log_every=3).attach(trainer)
    trainer.fit(3)
    assert capsys.readouterr().out.splitlines() == [
        "[training] step 3/10  elapsed 0:08  ETA 0:21  trained 1.5k tok/s  loss 1"
    ]


# ------------------------------------------------------------------ raw points, log y, shared x


def test_smoothing_keeps_every_raw_point_visible_under_the_curve():
    """An accuracy of 0.5, 1.0, 0.5, 1.0 smoothed with EMA weight 0.5 (debiased) passes through
    0.5, 0.8333, 0.6429, 0.8333 (e.g. 1.125 / 1.75 at step 3), values no step had: the raw
    points are drawn as markers, first (under the smoothed line)."""
    frame = pd.DataFrame({"step": [1, 2, 3, 4], "accuracy": [0.5, 1.0, 0.5, 1.0]})
    raw, smoothed = plot_metrics(frame, ["accuracy"], smooth=0.5).axes[0].lines
    assert raw.get_marker() == "o" and raw.get_alpha() > 0 and raw.get_markersize() > 0
    assert list(raw.get_ydata()) == [0.5, 1.0, 0.5, 1.0]
    assert list(smoothed.get_ydata()) == pytest.approx(
        [0.5, 1.25 / 1.5, 1.125 / 1.75, 1.5625 / 1.875]
    )


def test_panels_share_the_step_axis_and_loss_can_be_log_scale(displays):
    frame = pd.DataFrame(
        {
            "step": [1, 2, 3],
            "loss": [4.0, 0.4, 0.04],
            "lr": [1e-3, 1e-3, 1e-3],
            "kl": [0.0, -0.1, 0.2],
            "eval/accuracy": [float("nan"), 0.5, float("nan")],
        }
    )
    fig = plot_metrics(frame, ["loss", "lr", "kl", "eval/accuracy"], logy="loss")
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_yscale() for ax in axes] == ["log", "linear", "linear", "linear"]
    shared = axes[0].get_shared_x_axes()
    assert all(shared.joined(axes[0], ax) for ax in axes[1:])
    # 4 panels in 3 columns: each column's lowest panel has the step labels
    fig.canvas.draw()
    labelled = [any(t.get_visible() and t.get_text() for t in ax.get_xticklabels()) for ax in axes]
    assert labelled == [False, True, True, True]
    assert [ax.get_xlabel() for ax in axes] == ["", "step", "step", "step"]
    with pytest.raises(ValueError, match=r"logy: 'kl' has values <= 0 \(min -0.1\)"):
        plot_metrics(frame, ["loss", "kl"], logy=["kl"])
    with pytest.raises(ValueError, match=r"logy=\['reward'\]: not a plotted metric; allowed: "):
        plot_metrics(frame, ["loss"], logy=["reward"])
    with pytest.raises(ValueError, match=r"logy=\['kl'\]"):
        LiveDashboard(["loss"], logy="kl", widget=False)
    LiveDashboard(logy="lose", widget=False).attach(trainer := FakeTrainer())
    with pytest.warns(UserWarning, match=r"no column \['lose'\].*\(logy names no panel\)"):
        trainer.fit(1)
    # live: a log panel whose values reach <= 0 is drawn linear, and its title says so
    dash = LiveDashboard(["loss", "kl"], logy=["loss", "kl"], widget=True, min_interval_s=0)
    trainer = FakeTrainer()
    trainer.rows = frame[["step", "loss", "kl"]].to_dict("records")
    dash(trainer, trainer.rows[-1])
    assert [ax.get_yscale() for ax in dash._fig.axes[:2]] == ["log", "linear"]
    assert dash._fig.axes[1].get_title() == "KL to reference (nats/token) (linear: values <= 0)"
