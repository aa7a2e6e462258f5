"""Thread plan (count, wait policy, overrides), quiet progress lines in a log file, and the
torchao import notices kept out of posttrain's output.

The `posttrain` command is run as a real subprocess: OpenMP reads its settings once, when torch
is imported, so only a fresh process shows what a run gets. `OMP_DISPLAY_ENV=true` makes
libgomp print the settings it started with, which shows the wait policy was in place in time.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _waits import WAIT_S

from posttrain.core.info import thread_report
from posttrain.core.progress import progress_bar
from posttrain.core.threads import apply_thread_env, thread_plan

ROOT = Path(__file__).resolve().parents[2]
POSTTRAIN = str(Path(sys.executable).parent / "posttrain")
NOTICES = ("Skipping import of cpp extensions", "Detected no triton")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "OMP_NUM_THREADS",
            "OMP_WAIT_POLICY",
            "POSTTRAIN_NUM_THREADS",
            "MKL_NUM_THREADS",
            "OMP_DISPLAY_ENV",
        )
    }
    env.update(extra)
    return env


def test_plan_precedence_override_then_omp_then_affinity():
    assert thread_plan({}, cpus=3).num_threads == 3
    assert thread_plan({}, cpus=3).reason == "affinity mask: 3 CPUs"
    assert thread_plan({"OMP_NUM_THREADS": "1"}, cpus=3).num_threads == 1
    both = thread_plan({"OMP_NUM_THREADS": "1", "POSTTRAIN_NUM_THREADS": "4"}, cpus=3)
    assert (both.num_threads, both.reason) == (4, "POSTTRAIN_NUM_THREADS=4")
    assert thread_plan({}, cpus=1).reason == "affinity mask: 1 CPU"


def test_wait_policy_defaults_to_passive_and_keeps_an_explicit_one():
    assert thread_plan({}, cpus=2).wait_policy == "PASSIVE"
    assert thread_plan({}, cpus=2).policy_reason == "posttrain's default"
    active = thread_plan({"OMP_WAIT_POLICY": "active"}, cpus=2)
    assert (active.wait_policy, active.policy_reason) == ("ACTIVE", "OMP_WAIT_POLICY=ACTIVE")


@pytest.mark.parametrize(
    "name,value",
    [
        ("POSTTRAIN_NUM_THREADS", "0"),
        ("POSTTRAIN_NUM_THREADS", "two"),
        ("OMP_NUM_THREADS", "-1"),
        ("OMP_WAIT_POLICY", "lazy"),
    ],
)
def test_bad_settings_name_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        thread_plan({name: value}, cpus=2)


def test_apply_writes_the_policy_and_only_an_overridden_count():
    env = {}
    apply_thread_env(env, cpus=2)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}  # each process takes its own affinity mask
    env = {"POSTTRAIN_NUM_THREADS": "1"}
    apply_thread_env(env, cpus=2)
    assert env["OMP_NUM_THREADS"] == "1" and env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_thread_report_says_count_and_why():
    report = thread_report({"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE"})
    assert report["threads"] == "1 (OMP_NUM_THREADS=1)"
    assert report["wait policy"] == "ACTIVE (OMP_WAIT_POLICY=ACTIVE)"


def _info(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [POSTTRAIN, "info"], env=env, capture_output=True, text=True, timeout=WAIT_S
    )


def test_posttrain_info_sets_openmp_before_torch_starts():
    cpus = len(os.sched_getaffinity(0))
    proc = _info(_clean_env(OMP_DISPLAY_ENV="true"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in proc.stderr  # libgomp's own start-up report
    assert f"threads        {cpus} (affinity mask: {cpus} CPU" in proc.stdout
    assert f"torch threads  {cpus}\n" in proc.stdout
    assert "wait policy    PASSIVE (posttrain's default)" in proc.stdout
    assert not any(n in proc.stderr + proc.stdout for n in NOTICES)


def test_posttrain_info_follows_the_override_and_rejects_a_bad_one():
    proc = _info(_clean_env(POSTTRAIN_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch threads  1\n" in proc.stdout
    assert "threads        1 (POSTTRAIN_NUM_THREADS=1)" in proc.stdout
    bad = _info(_clean_env(POSTTRAIN_NUM_THREADS="0"))
    assert bad.returncode == 2 and "POSTTRAIN_NUM_THREADS='0'" in bad.stderr


def test_notice_filter_drops_exactly_those_records():
    """posttrain's filters sit on torchao's loggers: the two notices go, other records stay."""
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logging.getLogger("torchao").addHandler(handler)  # the child's records propagate to it
    try:
        logging.getLogger("torchao").warning(
            "Skipping import of cpp extensions due to "
            "incompatible torch version 2.13.0+cpu for torchao"
        )
        logging.getLogger("torchao.kernel.intmm").warning("Warning: Detected no triton, on ...")
        logging.getLogger("torchao").warning("Skipping import of cpp extensions: other reason")
        logging.getLogger("torchao.kernel.intmm").warning("something else")
    finally:
        logging.getLogger("torchao").removeHandler(handler)
    assert [r.getMessage() for r in seen] == [
        "Skipping import of cpp extensions: other reason",
        "something else",
    ]


def test_no_torchao_notices_in_posttrain_output():
    """With a root logging handler (verl installs one; without posttrain both notices print),
    importing torchao after posttrain prints neither (`posttrain info`: see above)."""
    code = "import logging; logging.basicConfig(); import posttrain, torchao.kernel.intmm"
    quiet = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env=_clean_env(),
    )
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert not any(n in quiet.stderr + quiet.stdout for n in NOTICES), quiet.stderr[-2000:]


def test_progress_lines_without_carriage_returns():
    """interval 0: a line at creation, one per update, one at close; each a whole line."""
    log = io.StringIO()
    bar = progress_bar(total=5, file=log, interval=0.0, desc="sft", unit="step")
    for _ in range(5):
        bar.set_postfix({"loss": 1.25}, refresh=False)
        bar.update(1)
    bar.close()
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert len(lines) == 7
    assert lines[0].startswith("sft:   0% 0/5") and lines[-1].startswith("sft: 100% 5/5")
    assert "loss=1.25" in lines[-1]
    with pytest.raises(ValueError, match="interval"):
        progress_bar(total=1, file=log, interval=-1.0)


TRAIN_LOOP = """
import torch
from posttrain.data import SFTDataset, SFTLoader
from posttrain.models import ByteTokenizer, ModelSpec, build_model
from posttrain.train import Trainer
torch.set_num_threads(1)
spec = ModelSpec(family="qwen2", vocab_size=272, num_layers=1, num_heads=2, num_kv_heads=1,
                 embed_dim=32, intermediate_dim=64, max_seq_len=32, rope_base=1e6, norm_eps=1e-6,
                 tie_word_embeddings=True)
rows = [{"prompt": f"{i}+1?", "completion": str(i + 1)} for i in range(8)]
loader = SFTLoader(SFTDataset(rows, ByteTokenizer(), max_seq_len=32), batch_size=4)
model = build_model(spec, seed=0)
trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), data=loader)
trainer.fit(40)
"""


def test_training_log_file_gets_a_few_plain_lines(tmp_path):
    """40 fast steps with stderr to a file: the start and end lines only (the next line would
    be due after 30 s), no carriage-return redraw per step."""
    log = tmp_path / "stderr.log"
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-c", TRAIN_LOOP],
            stderr=f,
            timeout=300,
            env=_clean_env(OMP_NUM_THREADS="1"),
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-2000:]
    progress = [line for line in text.splitlines() if "40 [" in line]
    assert "\r" not in text
    assert 2 <= len(progress) <= 3, text[-2000:]
    assert "100% 40/40" in progress[-1]


def test_a_local_job_gets_the_wait_policy(tmp_path, monkeypatch):
    """A job launched from a process without the settings (a notebook) still starts OpenMP
    with PASSIVE, and takes its thread count from its own affinity mask."""
    from posttrain.launch import launch

    def openmp_settings():  # nested: travels to the job by value
        import torch

        return os.environ.get("OMP_WAIT_POLICY"), torch.get_num_threads()

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("POSTTRAIN_NUM_THREADS", raising=False)
    run = launch(openmp_settings, folder=tmp_path / "job", timeout_min=20)
    run.wait(timeout=WAIT_S, poll_s=0.2)
    assert run.result() == ("PASSIVE", len(os.sched_getaffinity(0)))
