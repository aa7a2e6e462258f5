"""The code sandbox (posttrain.verifiers.sandbox): its limits, outcome rules, availability, ordinary
programs, the worker pool and pickling. Hostile programs: tests/verifiers/test_sandbox_hostile.py.

Tests that run programs need a sandbox (root + bubblewrap: scripts/sandbox-up.sh) and skip with the
reason `sandbox_available()` gives when there is none.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import time

import cloudpickle
import pytest
from _sandbox_helpers import host_processes_of
from _waits import LATE_S, WAIT_S

from posttrain.verifiers import sandbox as sandbox_module
from posttrain.verifiers import sandbox_exec
from posttrain.verifiers.sandbox import (
    ExecOutcome,
    ExecutionResult,
    Sandbox,
    SandboxLimits,
    SandboxUnavailable,
    classify,
    sandbox_available,
)

# ---------------------------------------------------------------------------------------------
# Limits and classification (no sandbox needed)


def test_limits_defaults_are_the_contract():
    assert SandboxLimits() == SandboxLimits(
        cpu_s=5.0,
        wall_s=10.0,
        memory_mb=512,
        file_size_mb=16,
        open_files=64,
        processes=32,
        output_bytes=1_000_000,
    )


@pytest.mark.parametrize(
    "field,value,error,words",
    [
        ("cpu_s", True, TypeError, r"cpu_s=True; must be a finite number in \[0\.001, 86400\.0\]"),
        ("wall_s", "10", TypeError, r"wall_s='10'; must be a finite number in \[0\.001, "),
        ("memory_mb", 512.0, TypeError, r"memory_mb=512\.0; must be an integer in \[16, "),
        ("memory_mb", 8, ValueError, r"memory_mb=8; must be an integer in \[16, "),
        ("cpu_s", float("inf"), ValueError, r"cpu_s=inf; must be a finite number"),
        ("cpu_s", 10**400, ValueError, r"cpu_s=1000.*; must be a finite number in \[0\.001, "),
        ("wall_s", 0, ValueError, r"wall_s=0; must be a finite number in \[0\.001, "),
        ("open_files", 3, ValueError, r"open_files=3; must be an integer in \[8, "),
        ("processes", 0, ValueError, r"processes=0; must be an integer in \[1, "),
    ],
)
def test_limits_refuse_bad_values(field, value, error, words):
    with pytest.raises(error, match=words):
        SandboxLimits(**{field: value})


@pytest.mark.parametrize(
    "field,value",
    [
        ("memory_mb", 10**30),
        ("cpu_s", 1e300),
        ("processes", 10**20),
        ("open_files", 10**9),
        ("file_size_mb", 10**15),
        ("wall_s", 1e300),
        ("output_bytes", 2**40),
        ("cpu_s", sandbox_module.MAX_SECONDS + 1),
        ("memory_mb", sandbox_module.MAX_MEMORY_MB + 1),
        ("file_size_mb", sandbox_module.MAX_FILE_SIZE_MB + 1),
    ],
)
def test_limits_refuse_values_above_their_range(field, value):
    """Values past what the C types, the host's hard rlimits or bubblewrap accept were
    sandbox_error (OverflowError, "not allowed to raise maximum limit") or raised from run."""
    high = sandbox_module.limit_ranges()[field][1]
    with pytest.raises(
        ValueError,
        match=rf"SandboxLimits\.{field}=.*; must be an? .* in "
        rf"\[.*, {high}\]",
    ):
        SandboxLimits(**{field: value})


def test_limit_ranges_follow_the_hosts_hard_rlimits():
    import resource

    ranges = sandbox_module.limit_ranges()
    assert set(ranges) == {f for f in SandboxLimits.__dataclass_fields__}
    nofile, nproc = (
        resource.getrlimit(r)[1] for r in (resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC)
    )
    assert ranges["open_files"][1] == (
        1 << 20 if nofile == resource.RLIM_INFINITY else min(nofile, 1 << 20)
    )
    assert ranges["processes"][1] == (
        1 << 22 if nproc == resource.RLIM_INFINITY else min(nproc, 1 << 22)
    )
    with pytest.raises(ValueError, match="open_files"):
        SandboxLimits(open_files=ranges["open_files"][1] + 1)


def test_every_field_at_its_maximum_and_minimum_runs(box):
    """The bounds are the real ones: a program runs at each end of every range."""
    ranges = sandbox_module.limit_ranges()
    high = SandboxLimits(**{name: high for name, (_, high) in ranges.items()})
    result = box.run("print('hi')", limits=high)
    assert (result.outcome, result.stdout) == (ExecOutcome.OK, "hi\n"), result.stderr
    low = SandboxLimits(
        **({name: low for name, (low, _) in ranges.items()} | {"cpu_s": 1.0, "wall_s": 10.0})
    )
    result = box.run("print('hi')", limits=low)  # 1 output byte: cut after "h"
    assert (result.outcome, result.stdout) == (ExecOutcome.OUTPUT_LIMIT, "h"), result.stderr


def _raw(status="", killed_for="", stderr=b"", stdout_cut=False) -> sandbox_exec.RawRun:
    return sandbox_exec.RawRun(
        status=status,
        killed_for=killed_for,
        stdout=b"out",
        stderr=stderr,
        stdout_cut=stdout_cut,
        stderr_cut=False,
        bwrap_code=0,
        wall_s=0.5,
    )


@pytest.mark.parametrize(
    "raw,outcome,code,sig",
    [
        (_raw("exit 0 0.010\n"), ExecOutcome.OK, 0, None),
        (_raw("exit 3 0.010\n"), ExecOutcome.FAILED, 3, None),
        (_raw("exit 1 0.2\n", stderr=b"Traceback ...\nMemoryError\n"), ExecOutcome.MEMORY, 1, None),
        (
            _raw("exit 1 0.2\n", stderr=b"MemoryError: no\nValueError: x\n"),
            ExecOutcome.FAILED,
            1,
            None,
        ),
        (_raw("signal 24 1.001\n"), ExecOutcome.TIMEOUT, None, 24),
        (_raw("signal 9 2.000\n"), ExecOutcome.TIMEOUT, None, 9),  # hard CPU limit (cpu_s 2)
        (_raw("signal 9 0.100\n"), ExecOutcome.KILLED, None, 9),
        (_raw("signal 11 0.100\n"), ExecOutcome.KILLED, None, 11),
        (_raw("", killed_for="wall"), ExecOutcome.TIMEOUT, None, 9),
        (
            _raw("exit 0 0.1\n", killed_for="output", stdout_cut=True),
            ExecOutcome.OUTPUT_LIMIT,
            None,
            9,
        ),
        (_raw(""), ExecOutcome.SANDBOX_ERROR, None, None),
        (_raw("error PermissionError: [Errno 1] no\n"), ExecOutcome.SANDBOX_ERROR, None, None),
    ],
)
def test_classify_rules(raw, outcome, code, sig):
    result = classify(raw, SandboxLimits(cpu_s=2.0))
    assert (result.outcome, result.exit_code, result.signal) == (outcome, code, sig)
    assert result.stdout == "out" and result.wall_s == 0.5


def test_sandbox_error_says_what_failed():
    result = classify(_raw("error PermissionError: [Errno 1] no\n"), SandboxLimits())
    assert result.stderr.startswith("sandbox: error PermissionError: [Errno 1] no")


def test_rlimit_arguments():
    args = sandbox_exec.rlimit_args(
        cpu_s=1.2, memory_mb=256, file_size_mb=2, open_files=10, processes=5
    )
    triples = {args[i]: (int(args[i + 1]), int(args[i + 2])) for i in range(0, len(args), 3)}
    assert triples == {
        "RLIMIT_CPU": (2, 3),
        "RLIMIT_AS": (256 * 2**20,) * 2,
        "RLIMIT_FSIZE": (2 * 2**20,) * 2,
        "RLIMIT_NOFILE": (10, 10),
        "RLIMIT_NPROC": (5, 5),
        "RLIMIT_CORE": (0, 0),
    }


# ---------------------------------------------------------------------------------------------
# Availability


def test_unavailable_without_bwrap_raises_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox_module, "_available_here", False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no bwrap on PATH
    if os.geteuid() == 0:
        reason = sandbox_available()
        assert reason is not None and "bubblewrap (bwrap) is not installed" in reason
    else:
        reason = sandbox_available()
        assert reason is not None and "needs root" in reason
    with pytest.raises(SandboxUnavailable) as info:
        Sandbox()
    assert str(info.value) == reason


def test_unpickled_where_no_sandbox_can_be_made_run_raises(box, monkeypatch, tmp_path):
    clone = pickle.loads(pickle.dumps(box))
    monkeypatch.setattr(sandbox_module, "_available_here", False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        clone.run("print(1)")


def test_unavailable_when_not_root(monkeypatch):
    if os.geteuid() != 0:
        assert "needs root" in sandbox_available()
        return
    monkeypatch.setattr(sandbox_module, "_available_here", False)
    os.seteuid(65534)  # a real non-root effective uid
    try:
        reason = sandbox_available()
        with pytest.raises(SandboxUnavailable):
            Sandbox()
    finally:
        os.seteuid(0)
    assert "needs root" in reason and "uid 65534" in reason


def test_bwrap_failing_is_a_sandbox_error_not_an_exception(box, monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"  # a bubblewrap that cannot set up
    fake.write_text("#!/bin/sh\necho 'bwrap: Creating new namespace failed' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    result = box.run("print(1)")
    assert result.outcome is ExecOutcome.SANDBOX_ERROR and result.stdout == ""
    assert "bwrap: Creating new namespace failed" in result.stderr


def test_bad_arguments(box):
    with pytest.raises(TypeError, match="source must be a str"):
        box.run(b"print(1)")
    with pytest.raises(TypeError, match="stdin must be a str"):
        box.run("print(1)", stdin=None)
    with pytest.raises(TypeError, match="limits must be a SandboxLimits"):
        box.run("print(1)", limits={"cpu_s": 1})
    with pytest.raises(TypeError, match="sources must be a sequence of str"):
        box.run_many("print(1)")
    with pytest.raises(ValueError, match="max_workers must be an int >= 1"):
        Sandbox(max_workers=0)


# ---------------------------------------------------------------------------------------------
# Ordinary programs


def test_print_stdin_and_utf8(box):
    result = box.run(
        "import sys\nprint(int(input()) * 2)\nprint('é')\n"
        "sys.stdout.flush(); sys.stdout.buffer.write(b'\\xff\\n')",
        stdin="21\n",
    )
    assert isinstance(result, ExecutionResult)
    assert (result.outcome, result.exit_code, result.signal) == (ExecOutcome.OK, 0, None)
    assert result.stdout == "42\né\n\ufffd\n" and result.stderr == ""
    assert not result.stdout_truncated and 0 < result.wall_s < LATE_S


def test_large_stdin_is_streamed(box):
    text = "x" * 3_000_000  # far above a pipe's 64 KiB
    result = box.run("import sys\nprint(len(sys.stdin.read()))", stdin=text)
    assert result.outcome is ExecOutcome.OK and result.stdout == "3000000\n"


def test_source_that_is_not_valid_utf8_is_the_programs_failure(box):
    result = box.run("print('\ud800')\n")  # a lone surrogate: no UTF-8 for it
    assert result.outcome is ExecOutcome.FAILED and "SyntaxError" in result.stderr


@pytest.mark.parametrize(
    "source", ["print('a')\x00print('b')", "\x00", "print(1)\n\x00", "x = 1  # \x00 in a comment"]
)
def test_source_with_a_nul_byte_is_not_run_and_fails(box, source):
    """python3.11 stops reading main.py at a NUL and ran the prefix (outcome ok, stdout 'a')."""
    for result in (box.run(source), *box.run_many([source, source])):
        assert (result.outcome, result.exit_code, result.signal) == (ExecOutcome.FAILED, None, None)
        assert result.stdout == "" and "cannot contain null bytes" in result.stderr


def test_a_nul_byte_on_stdin_is_passed_through(box):
    result = box.run("import sys\nprint(repr(sys.stdin.read()))", stdin="a\x00b")
    assert (result.outcome, result.stdout) == (ExecOutcome.OK, "'a\\x00b'\n")


def test_exception_is_failed_with_traceback(box):
    result = box.run("raise KeyError('boom')")
    assert (result.outcome, result.exit_code) == (ExecOutcome.FAILED, 1)
    assert "KeyError: 'boom'" in result.stderr


def test_os_exit_code_is_reported(box):
    result = box.run("import os\nprint('before', flush=True)\nos._exit(3)\nprint('after')")
    assert (result.outcome, result.exit_code, result.signal) == (ExecOutcome.FAILED, 3, None)
    assert result.stdout == "before\n"
    assert box.run("import os\nos._exit(0)").outcome is ExecOutcome.OK


def test_source_is_a_file_in_the_private_folder_not_an_argument(box):
    marker = "MARKER_7c1e9"
    source = (
        f"# {marker}\nimport os\nprint(os.getcwd(), __file__, open(__file__).read() == "
        f"open('/sandbox/main.py').read())\n"
        f"hits = [p for p in os.listdir('/proc') if p.isdigit() and "
        f"'{marker[:6]}' + '{marker[6:]}' in open(f'/proc/{{p}}/cmdline').read()]\n"
        f"print(hits)"
    )
    result = box.run(source)
    assert result.stdout == "/sandbox /sandbox/main.py True\n[]\n", result.stderr


def test_runs_as_an_unprivileged_uid_without_capabilities(box):
    result = box.run(
        "import os\nstatus = open('/proc/self/status').read().splitlines()\n"
        "print(os.getuid(), os.getgid(), os.getgroups())\n"
        "print([l.split()[1] for l in status if l.startswith(('CapEff', 'CapPrm', "
        "'CapAmb', 'NoNewPrivs'))])"
    )
    uid, gid, groups = result.stdout.splitlines()[0].split(" ", 2)
    assert sandbox_exec.UID_BASE <= int(uid) < sandbox_exec.UID_BASE + sandbox_exec.UID_SLOTS
    assert gid == uid and groups == "[]"
    assert (
        result.stdout.splitlines()[1] == "['0000000000000000', '0000000000000000', "
        "'0000000000000000', '1']"
    )


# ---------------------------------------------------------------------------------------------
# Pool and pickling


def _running(sleep_s: float, i: int) -> str:
    """A program that prints i, its uid and the host clock (the sandbox shares it) when it
    starts and when it ends, `sleep_s` apart."""
    return (
        f"import os, time\nstart = time.time()\ntime.sleep({sleep_s})\n"
        f"print({i}, os.getuid(), start, time.time())"
    )


def test_run_many_keeps_order_and_runs_in_parallel(box):
    """In parallel the four programs were all running at one moment (the latest start comes
    before the earliest end); one worker runs them one after the other (each starts after the
    previous one ended). Read from the programs' own clocks, so a slow start cannot fail it."""
    parallel = Sandbox(box.limits, max_workers=4)
    try:
        results = parallel.run_many([_running(3.0, i) for i in range(4)])
    finally:
        parallel.close()
    assert [r.outcome for r in results] == [ExecOutcome.OK] * 4
    assert [int(r.stdout.split()[0]) for r in results] == [0, 1, 2, 3]
    assert len({r.stdout.split()[1] for r in results}) == 4  # one uid each
    spans = [tuple(map(float, r.stdout.split()[2:])) for r in results]
    assert max(s for s, _ in spans) < min(e for _, e in spans), spans
    serial = Sandbox(box.limits, max_workers=1)
    results = serial.run_many([_running(0.2, i) for i in range(2)])
    assert [r.stdout.split()[0] for r in results] == ["0", "1"]
    (_, first_end), (second_start, _) = (tuple(map(float, r.stdout.split()[2:])) for r in results)
    assert first_end <= second_start
    assert box.run_many([]) == []


def test_sandbox_pickles_without_its_pool(box):
    box.run_many(["print(1)"])  # makes the pool
    for dumps, loads in [(pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)]:
        clone = loads(dumps(box))
        assert clone.limits == box.limits and clone.max_workers == box.max_workers
        assert clone._pool is None
        assert clone.run("print(6 * 7)").stdout == "42\n"


def test_sweep_kills_what_a_slot_uid_left_on_the_host(box):
    """The second layer: a process owned by a held slot's uid, started outside any sandbox."""
    slot, lock_fd = sandbox_exec.acquire_slot(time.monotonic() + WAIT_S)
    uid = sandbox_exec.UID_BASE + slot
    try:
        stray = subprocess.Popen(
            ["/usr/bin/sleep", "30"], user=uid, group=uid, extra_groups=[], cwd="/"
        )
        assert host_processes_of(uid) == [stray.pid]
        assert sandbox_exec.sweep_uid(uid) == 1
        assert stray.wait(timeout=WAIT_S) == -signal.SIGKILL
        assert sandbox_exec.sweep_uid(uid) == 0
    finally:
        os.close(lock_fd)
