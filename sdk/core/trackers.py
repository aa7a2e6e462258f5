"""Experiment trackers: the metric rows, resolved config, lineage and plots of a run, mirrored to
TensorBoard, Weights & Biases (offline by default) and MLflow (a local store by default), chosen
by name (`TRACKERS`).

A tracker never stops training. `Trackers` holds the trackers of one run and guards every call:
the first exception a tracker raises (its package missing, a full disk, a server down) is warned
once, counted in `failures` and `report()` (which recipes copy into results.json as
"trackers"), and that tracker is dropped for the rest of the run; the others go on.

`Trackers` is an engine callback (`trackers(engine, row)`), so a `Trainer` or `RLTrainer` given
`callbacks=[trackers]` sends it every row it records. Steps are the rows' "step".

Example:
    >>> import tempfile
    >>> t = Trackers(["tensorboard"], tempfile.mkdtemp())
    >>> t.start({"optim": {"lr": 0.002}}, {"run_id": "r"})
    >>> t.log({"step": 1, "loss": 2.5})
    >>> t.finish()
    >>> t.report()
    {'tensorboard': {'failures': 0}}
"""

from __future__ import annotations

import json
import numbers
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "TENSORBOARD_DIR",
    "TRACKERS",
    "WANDB_MODES",
    "Tracker",
    "TensorBoardTracker",
    "WandbTracker",
    "MlflowTracker",
    "Trackers",
    "register_tracker",
    "flat_config",
]

TENSORBOARD_DIR = "tensorboard"
"""Sub-folder of a run folder holding TensorBoard event files."""

WANDB_MODES = ("offline", "online", "disabled")
"""The `mode` values `wandb.init` takes; offline writes `<dir>/wandb/offline-run-*` only."""

PLOT_SUFFIXES = (".png", ".jpg", ".jpeg")


class Tracker(Protocol):
    """One experiment tracker of one run. Every method may raise; `Trackers` contains it."""

    def start(self, config: dict[str, Any], lineage: dict[str, Any]) -> None:
        """Open the tracker's run and record the resolved config and the lineage."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record one row of numbers (finite or not) at `step`."""

    def log_plots(self, paths: Sequence[Path]) -> None:
        """Record image files (the run's plots)."""

    def finish(self) -> None:
        """Flush and close."""


TRACKERS: dict[str, Callable[..., Tracker]] = {}
"""Tracker builders by name; each is called as `builder(run_dir, **options)`."""


def register_tracker(name: str, builder: Callable[..., Tracker]) -> None:
    """Add a tracker by name. Raises ValueError if `name` is taken."""
    if name in TRACKERS:
        raise ValueError(f"tracker {name!r} is registered already")
    TRACKERS[name] = builder


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"optim": {"lr": 0.1}}` -> `{"optim.lr": 0.1}` (the dotted keys of the CLI); lists and
    other leaves are kept as they are."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flat_config(value, name + "."))
        else:
            flat[name] = value
    return flat


class _EventStream:
    """The one `SummaryWriter` of a TensorBoard folder in this process, shared by every
    `TensorBoardTracker` open on it (a recipe's tracker and a `Trainer(tensorboard=True)` on the
    same run folder): one event file, each scalar written once per (tag, step)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.users = 0
        self.last_step: dict[str, int] = {}  # per tag: the last step written

    def add_scalars(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            if step > self.last_step.get(key, -1):  # another user wrote (key, step) already
                self.writer.add_scalar(key, value, global_step=step)
                self.last_step[key] = step
        self.writer.flush()

    def purge(self, step: int) -> None:
        # What SummaryWriter(purge_step=step) writes when it opens a file: TensorBoard's readers
        # then drop the events at steps >= `step` written before this one (a resumed run's).
        from tensorboard.compat.proto.event_pb2 import (  # type: ignore[import-untyped]
            Event,
            SessionLog,
        )

        file_writer = self.writer.file_writer  # set from SummaryWriter() until close()
        assert file_writer is not None, "the stream is closed"
        file_writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))
        self.writer.flush()
        self.last_step = {k: min(v, step - 1) for k, v in self.last_step.items()}


_STREAMS: dict[str, _EventStream] = {}
_STREAMS_LOCK = threading.Lock()


class TensorBoardTracker:
    """Scalars (tag = metric name) under `run_dir/tensorboard`; the config and lineage as text
    (tags "config" and "lineage", JSON); plots as images (tag "plots/<file stem>", HWC uint8).

    Every `TensorBoardTracker` of one folder in a process writes through one `SummaryWriter`
    (one event stream): a scalar already written at a step by another (the same row sent by the
    trainer's `tensorboard=True` and by a tracker callback) is not written again. `open` starts
    the stream without the text (what `MetricsLog(tensorboard=True)` uses); `purge(step)` hides
    the events at steps >= `step` written before it (a resume); `finish` leaves the stream to the
    others and closes it after the last.
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.log_dir = Path(run_dir) / TENSORBOARD_DIR
        self._stream: _EventStream | None = None
        self._last_step = 0

    @property
    def _writer(self) -> Any:
        assert self._stream is not None, "open() or start() first"
        return self._stream.writer

    def open(self) -> None:
        """Join the folder's event stream (start it if no tracker holds it). Idempotent."""
        if self._stream is not None:
            return
        key = os.path.abspath(self.log_dir)
        with _STREAMS_LOCK:
            stream = _STREAMS.get(key)
            if stream is None:
                stream = _STREAMS[key] = _EventStream(self.log_dir)
            stream.users += 1
        self._stream = stream

    def start(self, config: dict[str, Any], lineage: dict[str, Any]) -> None:
        self.open()
        self._writer.add_text("config", _json_block(config), global_step=0)
        self._writer.add_text("lineage", _json_block(lineage), global_step=0)
        self._writer.flush()

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.open()
        assert self._stream is not None
        self._stream.add_scalars(metrics, step)
        self._last_step = step

    def purge(self, step: int) -> None:
        """Make TensorBoard drop this folder's events at steps >= `step` written so far (also
        those of an earlier process): a run resumed from the checkpoint of step `step - 1`."""
        self.open()
        assert self._stream is not None
        self._stream.purge(step)

    def log_plots(self, paths: Sequence[Path]) -> None:
        import numpy as np
        from PIL import Image

        for path in paths:
            image = np.asarray(Image.open(path).convert("RGB"))
            self._writer.add_image(
                f"plots/{path.stem}", image, global_step=self._last_step, dataformats="HWC"
            )

    def finish(self) -> None:
        stream, self._stream = self._stream, None
        if stream is None:
            return
        with _STREAMS_LOCK:
            stream.users -= 1
            if stream.users > 0:
                stream.writer.flush()
                return
            _STREAMS.pop(os.path.abspath(self.log_dir), None)
        stream.writer.close()


class WandbTracker:
    """A Weights & Biases run: `wandb.init(project, mode, dir)` with the resolved config as the
    run config (its lineage under the key "lineage"), `run.log(row, step=step)`, plots as
    `wandb.Image` under "plots/<file stem>". `mode="offline"` (the default) writes only
    `<dir>/wandb/offline-run-*/` (`wandb sync` uploads it later); `dir` defaults to the run
    folder."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        project: str = "posttrain",
        mode: str = "offline",
        dir: str | os.PathLike | None = None,
    ) -> None:
        if mode not in WANDB_MODES:
            raise ValueError(f"wandb mode={mode!r}; must be one of {', '.join(WANDB_MODES)}")
        self.run_dir = Path(run_dir)
        self.project, self.mode = project, mode
        self.dir = Path(dir) if dir else self.run_dir
        self._run: Any = None
        self._last_step = 0

    def start(self, config: dict[str, Any], lineage: dict[str, Any]) -> None:
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=self.project,
            mode=self.mode,  # type: ignore[arg-type]
            dir=str(self.dir),
            name=self.run_dir.name,
            config={**config, "lineage": lineage},
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
            reinit="create_new",
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)
        self._last_step = step

    def log_plots(self, paths: Sequence[Path]) -> None:
        import wandb

        if paths:
            images = {f"plots/{p.stem}": wandb.Image(str(p)) for p in paths}
            self._run.log(images, step=self._last_step)

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class MlflowTracker:
    """An MLflow run in experiment `experiment`: the resolved config as params (dotted keys,
    `flat_config`; values cut to MLflow's 6,000 characters), the lineage as the artifact
    `lineage.json` and tags `lineage.<key>` for its top-level strings, each row as metrics at
    its step (`log_batch`), plots as artifacts under `plots/`. `tracking_uri` None: an SQLite
    store `run_dir/mlflow/mlflow.db` with the artifacts in `run_dir/mlflow/artifacts`
    (`scripts/mlflow-up.sh RUN_DIR` serves it); or any URI MLflow takes (a server's http://...)."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        experiment: str = "posttrain",
        tracking_uri: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.experiment = experiment
        self.local = tracking_uri is None
        self.tracking_uri = tracking_uri or f"sqlite:///{self.run_dir / 'mlflow' / 'mlflow.db'}"
        self._client: Any = None
        self.run_id: str | None = None

    def start(self, config: dict[str, Any], lineage: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if self.local:
            (self.run_dir / "mlflow").mkdir(parents=True, exist_ok=True)
        client = MlflowClient(tracking_uri=self.tracking_uri)
        found = client.get_experiment_by_name(self.experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            location = (self.run_dir / "mlflow" / "artifacts").as_uri() if self.local else None
            experiment_id = client.create_experiment(self.experiment, artifact_location=location)
        tags = {f"lineage.{k}": v for k, v in lineage.items() if isinstance(v, str)}
        run = client.create_run(experiment_id, run_name=self.run_dir.name, tags=tags)
        self._client, self.run_id = client, run.info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flat_config(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            client.log_batch(self.run_id, params=params[i : i + 100])
        client.log_text(self.run_id, json.dumps(lineage, indent=2, default=str), "lineage.json")

    def log(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        self._client.log_batch(self.run_id, metrics=batch)

    def log_plots(self, paths: Sequence[Path]) -> None:
        for path in paths:
            self._client.log_artifact(self.run_id, str(path), "plots")

    def finish(self) -> None:
        if self._client is not None:
            self._client.set_terminated(self.run_id)
            self._client = None


register_tracker("tensorboard", TensorBoardTracker)
register_tracker("wandb", WandbTracker)
register_tracker("mlflow", MlflowTracker)


class Trackers:
    """The trackers of one run, each call guarded (see the module docstring).

    Args:
        names: tracker names from `TRACKERS` (none: every call is a no-op).
        run_dir: the run folder (TensorBoard's and the W&B offline files go under it).
        options: per tracker name, the keywords of its builder (`{"wandb": {"mode": ...}}`).

    Raises:
        ValueError: for a name not in `TRACKERS` (lists the allowed names) or a repeated one.
    """

    def __init__(
        self,
        names: Iterable[str],
        run_dir: str | os.PathLike,
        options: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        names = list(names)
        for name in names:
            if name not in TRACKERS:
                raise ValueError(
                    f"unknown tracker {name!r}; allowed: {', '.join(sorted(TRACKERS))}"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"trackers {names} name one tracker twice")
        self.run_dir = Path(run_dir)
        self.failures = dict.fromkeys(names, 0)
        self.errors: dict[str, str] = {}
        self._live: dict[str, Tracker] = {}
        options = options or {}
        for name in names:
            self._guard(name, partial(self._build, name, options.get(name, {})))

    def _build(self, name: str, options: dict[str, Any]) -> None:
        self._live[name] = TRACKERS[name](self.run_dir, **options)

    def _guard(self, name: str, call: Callable[[], Any]) -> None:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - a tracker never stops training: counted, warned once
            self.failures[name] += 1
            self.errors[name] = f"{type(e).__name__}: {e}"
            self._live.pop(name, None)
            warnings.warn(
                f"tracker {name!r} failed ({self.errors[name]}); the run goes on without it",
                RuntimeWarning,
                stacklevel=3,
            )

    def _each(self, method: str, *args: Any) -> None:
        for name, tracker in list(self._live.items()):
            self._guard(name, partial(_call, tracker, method, *args))

    def start(self, config: dict[str, Any], lineage: dict[str, Any]) -> None:
        """Open every tracker's run with the resolved `config` and the run's `lineage`."""
        self._each("start", config, lineage)

    def log(self, row: dict[str, Any]) -> None:
        """Send the numbers of a metrics row (its integer "step" is the step; booleans and
        non-numbers are left out)."""
        if not self._live:
            return
        step = row["step"]
        numbers_ = {
            k: float(v)
            for k, v in row.items()
            if k != "step" and isinstance(v, numbers.Real) and not isinstance(v, bool)
        }
        self._each("log", numbers_, step)

    def __call__(self, engine: Any, row: dict[str, Any]) -> None:
        """The engine callback form of `log`."""
        self.log(row)

    def finish(self, plots_dir: str | os.PathLike | None = None) -> None:
        """Send the image files directly in `plots_dir` (the run folder's plots; None: none),
        then close every tracker. Safe to call twice."""
        if plots_dir is not None and self._live:
            plots = sorted(
                p for p in Path(plots_dir).iterdir() if p.suffix.lower() in PLOT_SUFFIXES
            )
            self._each("log_plots", plots)
        self._each("finish")
        self._live.clear()

    def report(self) -> dict[str, dict[str, Any]]:
        """Per tracker: `{"failures": count}`, with `"error"` (the first one) where it failed."""
        return {
            name: {"failures": n, **({"error": self.errors[name]} if name in self.errors else {})}
            for name, n in self.failures.items()
        }


def _call(tracker: Tracker, method: str, *args: Any) -> None:
    getattr(tracker, method)(*args)


def _json_block(value: dict[str, Any]) -> str:
    # indented four spaces: TensorBoard renders text as markdown, this keeps it a code block
    text = json.dumps(value, indent=2, default=str, sort_keys=True)
    return "\n".join("    " + line for line in text.splitlines())
