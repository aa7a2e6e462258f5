"""benchmarks/gpu/acceptance.py on CPU: its options, its refusal without CUDA, the rows of a
section that failed or overran, the FP8 loss check, and one section run at tiny size."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from _ranks import run_script
from _waits import WAIT_S

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "acceptance.py"


def _acceptance():
    """The script imported as a module (it puts benchmarks/gpu and benchmarks/ on sys.path)."""
    spec = importlib.util.spec_from_file_location("bench_gpu_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_acceptance_options_and_budgets(capsys):
    """Default budgets add up to 450 s (7.5 minutes: under the 8 of the target); one can be
    changed by name; an unknown section, a budget that is not > 0, and a CPU run of the whole
    table are refused naming the option."""
    m = _acceptance()
    args = m.parse_args([])
    assert args.sections == ["mfu", "fp8", "chunked_ce", "vllm"] and args.section is None
    assert sum(args.budgets.values()) == 450 < 8 * 60
    assert m.parse_args(["--budget", "fp8=240"]).budgets["fp8"] == 240.0
    for bad, says in (
        (["--budget", "speed=10"], "unknown section 'speed'"),
        (["--budget", "fp8=0"], "seconds must be a number > 0"),
        (["--budget", "fp8=soon"], "seconds must be a number > 0"),
        (["--device", "cpu"], "--device cpu runs one section"),
    ):
        with pytest.raises(SystemExit):
            m.parse_args(bad)
        assert says in capsys.readouterr().err


def test_acceptance_help_runs(tmp_path):
    proc = run_script(SCRIPT, ["--help"], tmp_path, timeout_s=WAIT_S)
    assert proc.returncode == 0 and "usage" in proc.stdout.lower(), proc.stderr[-2000:]


def test_acceptance_refuses_without_cuda_by_name(monkeypatch, capsys):
    """No CUDA: exit code 2, the reason on stderr, no table and no section started."""
    import torch

    m = _acceptance()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(m, "run_section", lambda *a, **k: pytest.fail("a section started"))
    assert m.main([]) == 2
    out = capsys.readouterr()
    assert "needs a CUDA GPU: torch.cuda.is_available() is False" in out.err
    assert "nothing was measured" in out.err and out.out == ""


def test_a_failed_or_overrunning_section_is_reported_in_its_row(monkeypatch):
    """A section whose process overruns its budget, one that exits with an error and one that
    prints its result: three rows, none hiding the others; `|` in a cell is escaped."""
    m = _acceptance()
    outcomes = iter(
        [
            subprocess.TimeoutExpired(cmd="x", timeout=5),
            subprocess.CompletedProcess("x", 1, stdout="", stderr="...\nCUDA out of memory\n"),
            subprocess.CompletedProcess(
                "x",
                0,
                stdout='noise\nACCEPTANCE-RESULT {"result": "a | b", "check": "pass"}\n',
                stderr="",
            ),
        ]
    )

    def fake_run(*args, **kwargs):
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(m.subprocess, "run", fake_run)
    rows = [m.run_section(name, 5, quick=True) for name in ("mfu", "fp8", "vllm")]
    assert rows[0]["result"] == "not measured: timed out after its budget of 5 s"
    assert rows[1]["result"] == "not measured: exit 1: CUDA out of memory"
    assert [r["check"] for r in rows] == ["FAIL", "FAIL", "pass"]
    text = m.table(rows, "header")
    assert text.count("\n| ") == 4 and "| vllm | a \\| b | pass |" in text


def test_fp8_check_fails_on_a_gap_to_bf16_or_a_loss_that_did_not_fall():
    """Bound = bf16 x 1.10 + 0.05: bf16 0.20 -> 0.27, so 0.26 passes and 0.30 fails; a loss of
    1.2 is above COPY_LOSS_MAX = 1.0 whatever bf16 reached."""
    m = _acceptance()
    import sections

    assert sections.fp8_check({"bf16": 0.20, "tensorwise": 0.26, "rowwise": 0.25}) == "pass"
    out = sections.fp8_check({"bf16": 0.20, "tensorwise": 0.30, "rowwise": 0.25})
    assert out == "FAIL: tensorwise 0.300 > bf16 bound 0.270"
    out = sections.fp8_check({"bf16": 1.2, "rowwise": 1.25})
    assert out.startswith("FAIL: bf16 1.200 >= 1.0; rowwise 1.250 >= 1.0")
    assert m.BUDGETS_S["fp8"] > 0


def test_copy_task_rows_repeat_their_pattern_and_ignore_the_first_period():
    """Period 16: token t+16 equals token t in every row; labels (shifted by one) of the first
    15 positions are ignored, the 16th onwards are the next input token."""
    _acceptance()
    import sections
    import torch

    from posttrain.data.loader import IGNORE_INDEX

    inputs, labels = sections.copy_batch(3, 40, torch.Generator().manual_seed(0), "cpu")
    assert inputs.shape == labels.shape == (3, 40)
    assert torch.equal(inputs[:, 16:], inputs[:, :-16])
    assert (labels[:, :15] == IGNORE_INDEX).all()
    assert torch.equal(labels[:, 15:-1], inputs[:, 16:])
    assert int(inputs.max()) < sections.COPY_ALPHABET


def test_chunked_ce_section_runs_on_cpu_and_the_chunk_uses_less_memory():
    """The section at tiny size (V=512, D=64, 2 x 128 tokens, chunks of 64): the unchunked loss
    holds 12 x 256 x 512 bytes of logits (1.5 MiB) at least, the chunked one 12 x 64 x 512."""
    _acceptance()
    import re

    import sections

    row = sections.section_chunked_ce("cpu", quick=True)
    mib = [float(x) for x in re.findall(r"([\d.]+) MiB", row["result"].replace(",", ""))]
    assert len(mib) == 2 and row["check"] == "-", row
    assert mib[0] > mib[1], row
