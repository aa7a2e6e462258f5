"""Shared fixtures.

`slurm_cluster`: the local single-host Slurm cluster started by `scripts/slurm-up.sh` (root and
apt needed; `make test` starts it when it can). Tests that use it skip when it is not up.

`vllm_server`: the suite's one real vLLM server (`VLLMServer`, tiny-1m), started on first use
(~1-2 minutes on a loaded machine) and closed when the session ends; tests skip without the vLLM
venv (`scripts/vllm-up.sh`). Its contract is in the fixture's docstring. Under `make test` each
pytest-xdist worker is a session of its own, so each worker that runs a vLLM test starts one.

Waiting and timing on a shared machine (a busy neighbour is the normal case: wall-clock time
runs 5-20x slower than on a quiet machine, and a process may wait 100 ms for a core). Defined
in `tests/_waits.py`, which test modules import (`from conftest import ...` finds
tests/notebook/browser/conftest.py instead when the whole suite runs):

- `wait_for(predicate, what=..., timeout=...)`: the one way a test waits for a state (a file a
  job writes, a process that starts or ends, a line in a log): polls until the predicate holds,
  and past a generous deadline fails with a message that names what it waited for. Never a bare
  `time.sleep(n)` as a wait, never a loop that gives up silently.
- `thread_cpu_s(fn)`: (fn(), CPU seconds this thread spent in it), for "linear, not quadratic"
  checks: CPU time does not grow while the process waits for a core, so a bound a few times
  above the linear cost and far below the quadratic one holds on a loaded machine.
- `LATE_S`: how late a call cut at its budget may return here; a test that checks a budget
  holds asserts the typed outcome, and that the call ended within budget + LATE_S, against work
  that would run far longer (minutes). Budgets of calls expected to succeed are generous.

A test run started in the background by a shell without job control inherits SIGINT ignored
(POSIX shells do that to asynchronous commands), and Python then installs no KeyboardInterrupt
handler: the Ctrl-C tests would see nothing. The session restores Python's default handler.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _waits import LATE_S, RUN_S, SKIP_NO_SLURM, WAIT_S, thread_cpu_s, wait_for  # noqa: F401

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

SLURM_DIR_DEFAULT = "/var/tmp/posttrain-slurm"


@dataclass(frozen=True)
class SlurmCluster:
    """The local cluster: its slurm.conf (exported as SLURM_CONF for the session), partition,
    nodes."""

    conf: str
    partition: str = "debug"
    nodes: list[str] = field(default_factory=lambda: ["n1", "n2"])


def _slurm_conf_from_env_sh(env_sh: Path) -> str | None:
    """The SLURM_CONF that `env.sh` (written by slurm-up.sh) exports, or None."""
    if not env_sh.is_file():
        return None
    match = re.search(r"^export SLURM_CONF=(\S+)\s*$", env_sh.read_text(), flags=re.MULTILINE)
    return match.group(1) if match else None


@pytest.fixture
def deterministic():
    """One thread and deterministic algorithms for the test (bitwise resume comparisons)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def slurm_cluster():
    """The local Slurm cluster, with `os.environ["SLURM_CONF"]` set while the session runs.

    Skips the test when `scripts/slurm-up.sh` has not started a cluster that answers `sinfo`.
    """
    slurm_dir = Path(os.environ.get("POSTTRAIN_SLURM_DIR", SLURM_DIR_DEFAULT))
    conf = _slurm_conf_from_env_sh(slurm_dir / "env.sh")
    if conf is None or not Path(conf).is_file():
        pytest.skip(SKIP_NO_SLURM)
    cluster = SlurmCluster(conf=conf)
    try:
        answer = subprocess.run(
            ["sinfo", "-h", "-N", "-p", cluster.partition, "-o", "%N %t"],
            env={**os.environ, "SLURM_CONF": conf},
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip(SKIP_NO_SLURM)
    if answer.returncode != 0 or not set(cluster.nodes) <= set(answer.stdout.split()):
        pytest.skip(SKIP_NO_SLURM)

    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    yield cluster
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """One real `VLLMServer` for the whole session, serving tiny-1m (started from
    `_policy_helpers.drawn_policy(0)`), float32, the default server options.

    Contract: tests share it in whatever order they run, so a test that needs particular
    weights syncs them first (`vllm_server.sync_weights(policy)`: ~0.1 s, the prefix cache
    reset) and never assumes which weights or `weight_version` the server holds when it begins;
    versions are compared relative to the one read after the sync. A test must leave it usable:
    a sync it made fail is followed by one that succeeds. It is never closed by a test:
    `vllm_server.close()` raises; lend it to an RLTrainer or as a rollout engine with
    `_vllm_helpers.SharedServerEngine(vllm_server, version=...)`, whose `close()` leaves the
    server running. Another process (the ranks of a distributed test) reaches it by
    `vllm_server.url`: `VLLMServer.attach(url, policy)` or `rollout_options={"url": url}`, which
    load their policy's weights, so the same contract holds for them. A test that needs another
    model, other server options or a fault starts a server of its own and says why in its
    docstring.

    Skips with `vllm_unavailable_reason()` (which names scripts/vllm-up.sh) without the venv.
    At the session's end it checks that closing left no process of the server's group.
    """
    from posttrain.policy.vllm_process import group_alive
    from posttrain.policy.vllm_server import VLLMServer, vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    from _policy_helpers import drawn_policy
    from _vllm_helpers import refuse_close

    server = VLLMServer.start(drawn_policy(0), tmp_path_factory.mktemp("vllm-shared"))
    server.close = refuse_close  # type: ignore[method-assign]
    try:
        yield server
    finally:
        VLLMServer.close(server)
    what = f"the shared vLLM server's process group {server.pgid} gone after close"
    wait_for(lambda: not group_alive(server.pgid), what=what, timeout=WAIT_S)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests, the previous setting restored after: tiny
    models gain nothing from intra-op threads, and on a shared 2-core machine a busy neighbour
    turns thread spin-waits into 100x slowdowns. A module opts in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
