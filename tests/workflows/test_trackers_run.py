"""A recipe run with `logging.trackers`: what TensorBoard and W&B (offline) hold, read back with
their own readers (TensorBoard's EventAccumulator; wandb's protobuf records of the offline run
file; MLflow's MlflowClient on the local store), against metrics.jsonl and config.json; a
tracker that raises does not stop the run; and every file and folder of the run (checkpoint,
plots, policy, and what the trackers' libraries write with plain `open()`) has the modes of
`checkpoint.permissions=shared`. One tiny SFT run (tiny-1m, 2 steps, a checkpoint at step 2)
carries every check.

A trainer's own `tensorboard=True` and a TensorBoard tracker on the same run folder share one
event stream (`posttrain.core.trackers.TensorBoardTracker`): checked on a `MetricsLog`, which is
what the trainer writes its rows through."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
from _file_modes import modes_under, wrong_modes
from _wandb_records import wandb_config, wandb_history

from posttrain.core.metrics import MetricsLog
from posttrain.core.run_permissions import current_umask
from posttrain.core.trackers import TRACKERS, Trackers
from posttrain.workflows.config import BatchOptimConfig, CheckpointConfig, TaskConfig
from posttrain.workflows.logging_config import LoggingConfig
from posttrain.workflows.sft import SFTConfig, run_sft


class DownServer:
    """A tracker whose server is down."""

    def __init__(self, run_dir, **options):
        pass

    def start(self, config, lineage):
        raise ConnectionError("connection refused")


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setitem(TRACKERS, "down", DownServer)
    mp.delenv("POSTTRAIN_RUN_PERMISSIONS", raising=False)
    out = tmp_path_factory.mktemp("tracked") / "run"
    cfg = SFTConfig(
        task=TaskConfig(train_size=64, eval_size=0),
        optim=BatchOptimConfig(steps=2, batch_size=4, warmup_steps=0),
        checkpoint=CheckpointConfig(every=2, permissions="shared"),
        logging=LoggingConfig(trackers=["tensorboard", "wandb", "mlflow", "down"], experiment="t"),
        out_dir=str(out),
        progress=False,
    )
    umask = os.umask(0o022)  # the usual umask, under which plain open() gives 0644
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = run_sft(cfg)
        assert current_umask() == 0o022  # restored after the run
    finally:
        os.umask(umask)
        mp.undo()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, results, rows, [str(w.message) for w in caught]


def test_a_down_tracker_is_counted_in_results_and_the_run_finishes(tracked_run):
    out, results, rows, warned = tracked_run
    assert [r["step"] for r in rows] == [1, 2]
    assert results["trackers"] == {
        "tensorboard": {"failures": 0},
        "wandb": {"failures": 0},
        "mlflow": {"failures": 0},
        "down": {"failures": 1, "error": "ConnectionError: connection refused"},
    }
    assert json.loads((out / "results.json").read_text())["trackers"] == results["trackers"]
    assert sum("tracker 'down' failed" in w for w in warned) == 1


def test_tensorboard_holds_every_row_at_its_step_the_config_and_the_plot(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, rows, _ = tracked_run
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0, "images": 0})
    acc.Reload()
    assert "loss" in acc.Tags()["scalars"]
    for key in ("loss", "lr"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2]
        assert [e.value for e in events] == pytest.approx([r[key] for r in rows], rel=1e-6)
    config_text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    saved = json.loads((out / "config.json").read_text())
    assert json.loads(config_text.replace("\n    ", "\n").strip()) == saved
    assert "plots/loss" in acc.Tags()["images"]


def test_wandb_offline_run_holds_every_row_at_its_step_and_the_config(tracked_run):
    out, _, rows, _ = tracked_run
    (run_file,) = Path(out / "wandb").glob("offline-run-*/run-*.wandb")
    history = wandb_history(run_file)
    for row in rows:
        assert history[row["step"]]["loss"] == pytest.approx(row["loss"], rel=1e-6)
        assert history[row["step"]]["lr"] == pytest.approx(row["lr"], rel=1e-6)
    assert history[2]["plots/loss/_type"] == "image-file"  # the plot, at the last step
    assert list(run_file.parent.glob("files/media/images/plots/loss_2_*.png"))
    config = wandb_config(run_file)
    saved = json.loads((out / "config.json").read_text())
    assert config["optim"] == saved["optim"] and config["seed"] == 0
    lineage = json.loads((out / "lineage.json").read_text())
    assert config["lineage"] == json.loads(json.dumps(lineage))


def test_mlflow_local_store_holds_every_row_at_its_step_the_config_and_the_plot(tracked_run):
    from mlflow.tracking import MlflowClient

    out, _, rows, _ = tracked_run
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    for key in ("loss", "lr"):
        history = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in history] == [1, 2]
        assert [m.value for m in history] == pytest.approx([r[key] for r in rows], rel=1e-6)
    saved = json.loads((out / "config.json").read_text())
    params = run.data.params
    assert params["optim.lr"] == str(saved["optim"]["lr"]) and params["task.name"] == "chain_sum"
    assert params["logging.trackers"] == "['tensorboard', 'wandb', 'mlflow', 'down']"
    lineage = json.loads((out / "lineage.json").read_text())
    assert run.data.tags["lineage.run"] == lineage["run"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"lineage.json", "plots"}
    assert [a.path for a in client.list_artifacts(run.info.run_id, "plots")] == ["plots/loss.png"]
    assert (out / "mlflow" / "artifacts").is_dir()  # inside the run folder, not the cwd


def test_every_file_and_folder_of_the_run_has_the_shared_modes(tracked_run):
    out, _, _, _ = tracked_run
    found = {p.relative_to(out).as_posix() for p in modes_under(out)}
    for written in (  # posttrain's own files, and those of torch, TensorBoard, SQLite, wandb
        "metrics.jsonl",
        "checkpoints/step_000002/model.pt",
        "loss.png",
        "mlflow/mlflow.db",
        "mlflow/artifacts",
    ):
        assert written in found, f"{written} not in the run folder: {sorted(found)}"
    assert any(p.startswith("tensorboard/events.out.tfevents.") for p in found)
    assert any(p.startswith("wandb/offline-run-") for p in found)
    assert wrong_modes(out, 0o660, 0o2770) == []


def test_trainer_tensorboard_and_a_tensorboard_tracker_write_one_event_stream(tmp_path):
    """A trainer with `tensorboard=True` records each row in its `MetricsLog`, then sends it to
    its callbacks (a `Trackers` with "tensorboard"): one event file, each scalar once per step,
    and the tracker's config text in the same stream. Then a resume (`reset` to the rows of the
    step-1 checkpoint) hides the old step 2 and the new step 2 is written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path, tensorboard=True)
    trackers = Trackers(["tensorboard"], tmp_path)
    trackers.start({"optim": {"lr": 0.1}}, {"run": "r"})
    rows = [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}]
    for row in rows:
        log.append(row)
        trackers(None, row)
    trackers.finish()
    log.close()
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")

    def scalars() -> list[tuple[int, float]]:
        acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
        acc.Reload()
        assert "config/text_summary" in acc.Tags()["tensors"]
        return [(e.step, e.value) for e in acc.Scalars("loss")]

    assert scalars() == [(1, 2.5), (2, 2.0)]

    resumed = MetricsLog(tmp_path, tensorboard=True)  # a new process resuming from step 1
    resumed.reset(rows[:1])
    resumed.append({"step": 2, "loss": 1.5})
    resumed.close()
    assert scalars() == [(1, 2.5), (2, 1.5)]
