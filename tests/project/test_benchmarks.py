"""Benchmark scripts are shipped artifacts: each parses its options (imports resolve)."""

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
from _ranks import run_script
from _waits import WAIT_S

FILES = sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py"))
# A script runs (`if __name__ == "__main__"`); a module holds a part of scripts and is imported.
SCRIPTS = [p for p in FILES if '__name__ == "__main__"' in p.read_text()]
MODULES = [p for p in FILES if p not in SCRIPTS]


def test_benchmarks_found():
    assert {"generation", "sft_throughput", "grpo_step"} <= {p.stem for p in SCRIPTS}


@pytest.mark.parametrize("module", MODULES, ids=[p.stem for p in MODULES])
def test_a_benchmark_module_is_imported_by_a_script(module):
    """A module without a command of its own is exercised through a script that imports it
    (whose --help test below imports it too)."""
    users = [
        p.stem
        for p in SCRIPTS
        if f"from {module.stem} import" in p.read_text()
        or f"import {module.stem}\n" in p.read_text()
    ]
    assert users, f"benchmarks/{module.name} is neither a script nor imported by one"


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_benchmark_help(script, tmp_path):
    """`python SCRIPT --help` (`_ranks.run_script`: forked with torch and posttrain already
    imported; the script's own imports resolve from a fresh interpreter's sys.path)."""
    proc = run_script(script, ["--help"], tmp_path, timeout_s=WAIT_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower()


def test_step_clock_times_the_steps_after_the_warmup(monkeypatch):
    """Ticks at 1, 3, 4, 7 s with 1 warm-up step and 3 timed: the timed steps run 1 -> 3,
    3 -> 4, 4 -> 7, so 2, 1, 3 s (median 2). Without a warm-up step the first timed step has no
    start; a block with another count of ticks is refused."""
    m = _benchmark_module("timing")
    ticks, cpu = iter([1.0, 3.0, 4.0, 7.0]), iter([0.5, 1.0, 3.0, 3.5])
    monkeypatch.setattr(
        m,
        "time",
        argparse.Namespace(perf_counter=lambda: next(ticks), process_time=lambda: next(cpu)),
    )
    clock, after = m.StepClock(), []
    clock.then = lambda: after.append(len(clock.times))
    for _ in range(4):
        clock.tick()
    setup = argparse.Namespace(warmup=1, steps=3)
    assert clock.durations(setup) == [2.0, 1.0, 3.0] and clock.median_step(setup) == 2.0
    assert clock.durations(setup, "cpu") == [0.5, 2.0, 0.5]  # CPU ticks 0.5, 1, 3, 3.5
    assert after == [1, 2, 3, 4]  # `then` runs after each tick
    with pytest.raises(ValueError, match="clock 'gpu'"):
        clock.durations(setup, "gpu")
    with pytest.raises(ValueError, match="warmup=0; must be >= 1"):
        clock.durations(argparse.Namespace(warmup=0, steps=4))
    with pytest.raises(ValueError, match="ticked 4 times; warmup=1 \\+ steps=2"):
        clock.durations(argparse.Namespace(warmup=1, steps=2))
    clock.clear()
    assert clock.times == clock.cpu_times == []


def test_step_clock_counts_a_blocks_timed_steps_by_both_clocks():
    """A block of 1 warm-up + 2 timed steps sampling 900, 950, 960 completion tokens, ticking at
    wall 1, 3, 6 s and CPU 0.5, 1, 2 s: the timed steps did 950 + 960 = 1910 tokens in
    2 + 3 = 5 wall s and 0.5 + 1 = 1.5 CPU s. A count of steps that is not the block's is
    refused."""
    m = _benchmark_module("timing")
    clock = m.StepClock()
    clock.times, clock.cpu_times = [1.0, 3.0, 6.0], [0.5, 1.0, 2.0]
    setup = argparse.Namespace(warmup=1, steps=2)
    assert clock.block_run(setup, [900, 950, 960]) == (1910, 5.0, 1.5)
    with pytest.raises(ValueError, match="2 steps counted; warmup=1 \\+ steps=2"):
        clock.block_run(setup, [950, 960])


def test_cpu_model_names_the_cpu_and_with_isa_its_vector_extensions(monkeypatch):
    m = _benchmark_module("timing")
    lscpu = (
        "Architecture:   x86_64\nModel name:     AMD EPYC 7B13\nCPU family:     25\n"
        "Model:          1\nFlags:          fpu sse2 fma avx2 avx512f\n"
    )
    monkeypatch.setattr(m.subprocess, "run", lambda *a, **k: argparse.Namespace(stdout=lscpu))
    assert m.cpu_model() == "AMD EPYC 7B13"
    assert m.cpu_model(isa=True) == "AMD EPYC 7B13 (family 25, model 1; avx2, fma, avx512f)"
    monkeypatch.setattr(
        m.subprocess, "run", lambda *a, **k: argparse.Namespace(stdout="Model name: X\n")
    )
    assert m.cpu_model(isa=True) == "X (family ?, model ?; no AVX2)"


def test_sft_throughput_quartiles_stay_within_the_ratios_seen():
    """Ratios 1 and 2: inclusive quartiles 1 + 0.25 = 1.25 and 1 + 0.75 = 1.75 (the default,
    exclusive method gives 0.75 and 2.25, outside what was measured); one ratio is its own
    quartiles."""
    m = _benchmark_module("sft_throughput_report")
    assert m._quartiles([2.0, 1.0]) == "1.25 - 1.75"
    assert m._quartiles([0.9]) == "0.90 - 0.90"


def test_grpo_vs_trl_quick_compares_both_trainers_on_one_scorer(tmp_path):
    """The side-by-side runs end to end at tiny size: both trainers train from the same SFT
    start and are scored by the same held-out evaluation (nothing is written with --quick)."""
    pytest.importorskip("trl")
    script = next(p for p in SCRIPTS if p.stem == "grpo_vs_trl")
    proc = run_script(script, ["--quick"], tmp_path, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    names = [row.split("|")[1].strip() for row in rows]
    assert {"SFT start", "posttrain GRPO", "TRL GRPO"} <= set(names)
    assert "TRL GRPO minus posttrain GRPO" in names
    assert "nan" not in proc.stdout.lower()


def test_generation_grouped_tiny_matches_transformers_tokens(tmp_path):
    """A G=4 run at tiny size: Policy.generate(prompts, n=4) with a shared prefill produces the
    same greedy tokens as transformers generate on the 4 copies (the script exits 1 otherwise)."""
    script = next(p for p in SCRIPTS if p.stem == "generation")
    proc = run_script(
        script,
        [
            "--batch",
            "8",
            "--group-size",
            "4",
            "--prompt-len",
            "8",
            "--new-tokens",
            "4",
            "--reps",
            "1",
            "--threads",
            "1",
            "--out",
            str(tmp_path / "gen"),
        ],
        tmp_path,
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Greedy tokens identical across the three methods: True" in proc.stdout
    assert "(2 prompts x G=4 samples)" in proc.stdout


def _benchmark_module(stem: str):
    """benchmarks/STEM.py (a script or a module) imported as `bench_STEM`, the folder on sys.path
    for its own imports (registered, so its dataclasses resolve their module)."""
    import importlib.util

    path = next(p for p in FILES if p.stem == stem)
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"bench_{stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_main_job_seeds_reports_mean_and_t_interval_over_seeds():
    """Seeds 0.20, 0.40, 0.60: mean 0.40, sd 0.20, t(0.975, 2) = 4.303 (table), half-width
    4.303 * 0.20 / sqrt(3) = 0.4969; differences are shown in points (x100)."""
    m = _benchmark_module("main_job_seeds")
    mean, low, high = m.mean_interval([0.2, 0.4, 0.6])
    assert mean == pytest.approx(0.4) and high - mean == pytest.approx(0.4969, rel=1e-3)
    assert low == pytest.approx(0.4 - 0.4969, rel=1e-3)
    per_seed = {
        s: {"after_sft": {"accuracy": a}, "difference": {"difference": d}}
        for s, a, d in ((0, 0.2, 0.01), (1, 0.4, 0.03), (2, 0.6, 0.05))
    }
    rows = {
        r.split("|")[1].strip(): r
        for r in m.report(per_seed, m.FIGURES, []).splitlines()
        if r.startswith("| ")
    }
    assert (
        "| 0.400 [-0.097, 0.897] | 0.200 | 0.600 | 0.200 | 0.400 | 0.600 |"
        in rows["greedy after SFT"]
    )
    # 1, 3, 5 points: sd 2, half-width 4.303 * 2 / sqrt(3) = 4.97
    assert "| +3.0 [-2.0, +8.0] |" in rows["GRPO minus SFT, greedy (points)"]
    assert "greedy after GRPO" not in rows  # a figure no seed has is left out


def test_beyond_demos_reports_every_arm_over_seeds_and_each_seeds_paired_difference():
    """GRPO greedy 0.20, 0.40, 0.60 at seeds 0-2: mean 0.40, sd 0.20, t(0.975, 2) = 4.303,
    half-width 4.303 * 0.20 / sqrt(3) = 0.497; an arm every seed has at 0 has the interval
    [0, 0]; an arm missing at one seed is left out; the paired cells are shown per seed."""
    m = _benchmark_module("beyond_demos")
    grpo = [{"greedy": g, "pass1": g / 2, "passk": g} for g in (0.2, 0.4, 0.6)]
    zero = {"greedy": 0.0, "pass1": 0.0, "passk": 0.0}
    values = {s: {"GRPO": grpo[s], "DPO": zero} for s in range(3)}
    values[0]["RFT"] = zero  # seed 0 alone: not a row
    paired = {s: {"DPO": {"greedy": f"+{s}.0 [x]", "pass1": f"+{s}.5 [y]"}} for s in range(3)}
    rows = [r for r in m.seeds_report(values, paired).splitlines() if r.startswith("| ")]
    assert "| GRPO | greedy | 0.400 [-0.097, 0.897] | 0.200 | 0.400 | 0.600 |" in rows
    assert "| GRPO | sampled pass@1 | 0.200 [-0.048, 0.448] | 0.100 | 0.200 | 0.300 |" in rows
    assert "| DPO | greedy | 0.000 [0.000, 0.000] | 0.000 | 0.000 | 0.000 |" in rows
    assert not any(r.startswith("| RFT") for r in rows)
    assert "| DPO, greedy | +0.0 [x] | +1.0 [x] | +2.0 [x] |" in rows
    assert "| DPO, sampled pass@1 | +0.5 [y] | +1.5 [y] | +2.5 [y] |" in rows


def test_main_job_seeds_reports_finished_runs_with_their_curves(tmp_path):
    """--reuse reads each seed's results.json from --work instead of running it; --plot draws
    the seeds' eval_curve.csv; the report names WORK/PLOT/OUT, not this machine's folders.
    Seeds 0.80 and 0.90 after SFT: mean 0.85, sd 0.0707, t(0.975, 1) = 12.706, half-width
    12.706 * 0.0707 / sqrt(2) = 0.635."""
    m = _benchmark_module("main_job_seeds")
    for seed, acc in ((0, 0.8), (1, 0.9)):
        run = tmp_path / "work" / f"seed{seed}"
        run.mkdir(parents=True)
        (run / "results.json").write_text(
            json.dumps({"after_sft": {"accuracy": acc}, "more_sft": {"accuracy": 0.95}})
        )
        (run / "eval_curve.csv").write_text(f"step,accuracy\n0,{acc}\n25,{acc + 0.01}\n")
    out, png = tmp_path / "report.md", tmp_path / "curves.png"
    assert (
        m.main(
            [
                "--seeds",
                "0",
                "1",
                "--work",
                str(tmp_path / "work"),
                "--reuse",
                "--plot",
                str(png),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = out.read_text()
    assert "| greedy after SFT | 0.850 [0.215, 1.485] | 0.800 | 0.900 | 0.800 | 0.900 |" in text
    assert "--work WORK --reuse --plot PLOT --out OUT" in text and str(tmp_path) not in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_grpo_vs_trl_report_names_the_command_not_the_local_folder():
    m = _benchmark_module("grpo_vs_trl")
    assert (
        m.command_line(["--sft-run", "/tmp/a", "--steps", "5"], Path("/tmp/a"))
        == "--sft-run RUN --steps 5"
    )
    assert m.command_line(["--sft-run=/tmp/a"], Path("/tmp/a")) == "--sft-run=RUN"
    assert m.command_line(["--steps", "5"], None) == "--steps 5"
    assert m.command_line(["--out", "/tmp/o", "--quick"], None) == "--out OUT --quick"


def test_rollout_throughput_pairs_runs_and_formats_a_cell():
    """vllm runs 64 tokens in 0.5, 0.25, 1.0 s -> 128, 256, 64 tok/s (median 128); builtin 64
    tokens in 1.0, 0.5, 0.5 s -> 64, 128, 128 (median 128); per-run ratios 2.0, 2.0, 0.5 ->
    median 2.00x [0.50, 2.00]. transformers 32 tokens in 1 s each -> 32 tok/s; ratios 4, 8, 2.
    CPU seconds: vllm 1, 3, 2 -> median 2.0; builtin 0.5; transformers 1, 1, 4 -> 1.0.
    Tokens per CPU second: vllm 64, 21.3, 32; builtin 128 each -> 0.50, 0.17, 0.25 -> 0.25x
    [0.17, 0.50]; transformers 32, 32, 8 -> 2, 0.67, 4 -> 2.00x [0.67, 4.00]."""
    m = _benchmark_module("rollout_throughput")
    runs = {
        "vllm": [(64, 0.5, 1.0), (64, 0.25, 3.0), (64, 1.0, 2.0)],
        "builtin": [(64, 1.0, 0.5), (64, 0.5, 0.5), (64, 0.5, 0.5)],
        "transformers": [(32, 1.0, 1.0), (32, 1.0, 1.0), (32, 1.0, 4.0)],
    }
    row = m.table_row("m", m.Shape("grouped", 8, 8), 2, runs, (1.25, 3.5))
    assert row == (
        "| m | 8 x 8 | 2 | 128 [64, 256] | 128 [64, 128] | 32 [32, 32] | 2.00x [0.50, 2.00] "
        "| 0.25x [0.17, 0.50] | 4.00x [2.00, 8.00] | 2.00x [0.67, 4.00] | 2.0, 0.5, 1.0 "
        "| 1.2-3.5 |"
    )
    assert row.count("|") == m.HEADER.splitlines()[0].count("|")


def test_rollout_throughput_binds_the_vllm_engine_to_the_asked_threads(monkeypatch):
    m = _benchmark_module("rollout_throughput")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    with m.vllm_threads(2):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
        assert os.environ["OMP_NUM_THREADS"] == "2"
    with m.vllm_threads(1):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and os.environ["OMP_NUM_THREADS"] == "7"


@pytest.mark.slow
def test_rollout_throughput_quick_runs_the_three_engines_on_both_shapes(
    vllm_server, monkeypatch, capsys
):
    """--quick on the suite's shared server (`main(server=...)`, in this process: the command's
    own server start is the one piece left out): tiny-1m, 1 thread, 2 prompts x n=2 and 4
    prompts x 1, 4 new tokens: every engine returns 16 tokens per call (no stop ids), and each
    shape gets one row with both ratios, by wall and by CPU time."""
    import torch

    m = _benchmark_module("rollout_throughput")
    from generation import NoStopByteTokenizer

    with pytest.raises(ValueError, match="stops at ids"), m.served(None, None, 1, 4, vllm_server):
        pass
    monkeypatch.setattr(vllm_server, "tokenizer", NoStopByteTokenizer())
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the command sets it: restored after
    threads = torch.get_num_threads()
    try:
        assert m.main(["--quick"], server=vllm_server) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    reps = [line.split() for line in out.splitlines() if line.strip().startswith("rep ")]
    assert sorted((r[2], r[3]) for r in reps) == sorted(
        (e, "16") for e in ("vllm", "builtin", "transformers") for _ in range(2)
    )
    rows = [line for line in out.splitlines() if line.startswith("| tiny-1m")]
    assert {r.split("|")[2].strip() for r in rows} == {"2 x 2", "4 x 1"}
    assert all(r.count("x [") == 4 for r in rows) and "nan" not in out.lower()  # wall, CPU x 2
    assert vllm_server.alive  # measured, not closed


def test_gpu_vllm_rollout_checks_its_arguments_and_formats_its_table(tmp_path):
    """Qwen2.5-1.5B by hand: embedding 151,936 x 1,536 = 233,373,696; per layer q 1536x1536 +
    1536 bias, k and v 1536x256 + 256 each, o 1536x1536, MLP 3 x 1536 x 8960, two norms:
    46,797,824; x 28 + embedding + final norm 1,536 = 1,543,714,304 (the model card's 1.54B).
    Syncs of 1.0/0.5/3.0 s total with reloads 0.4/0.2/2.0 s: medians 1.000 (0.400)."""
    m = _benchmark_module("gpu_vllm_rollout")
    assert m.QWEN25_1_5B.num_parameters() == 1_543_714_304
    args = m.parse_args([])
    assert args.models == ["qwen2.5-0.5b", "qwen2.5-1.5b"] and args.budget_s == 420
    for bad in (["--reps", "0"], ["--gpu-memory-utilization", "0.95"], ["--models", "x"]):
        with pytest.raises(SystemExit):
            m.parse_args(bad)
    sync = type("S", (), {})
    syncs = []
    for total, reload in ((1.0, 0.4), (0.5, 0.2), (3.0, 2.0)):
        s = sync()
        s.total_s, s.reload_s = total, reload
        syncs.append(s)
    assert m.sync_cell(syncs) == "1.000 (0.400)"
    runs = {"vllm": [(100, 0.1), (100, 0.2)], "builtin": [(100, 1.0), (100, 1.0)]}
    assert m.row("q", "8 x 8", runs, "x") == (
        "| q | 8 x 8 | 750 [500, 1,000] | 100 [100, 100] | 7.50x [5.00, 10.00] | x |"
    )
    assert m.shm_refusal(1, str(tmp_path)) is None
    assert m.shm_refusal(2**62, str(tmp_path)).startswith(f"skipped: {tmp_path} has ")
    assert m.IdTokenizer().stop_ids == frozenset() and m.IdTokenizer().decode([151935]) == "151935"


def test_gpu_vllm_rollout_refuses_without_cuda(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the refusal is for machines without it")
    script = next(p for p in SCRIPTS if p.stem == "gpu_vllm_rollout")
    proc = run_script(script, ["--models", "qwen2.5-0.5b"], tmp_path, timeout_s=WAIT_S)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "needs a CUDA GPU" in proc.stderr and "nothing was measured" in proc.stderr


def test_vllm_sync_cells_give_the_median_and_range_of_the_syncs():
    """Three syncs saving in 0.3, 0.1, 0.2 s -> median 0.200, range 0.100-0.300; totals
    0.3+0.2+0.01, 0.1+0.4+0.01, 0.2+0.2+0.02 = 0.51, 0.51, 0.42 -> 0.510 (0.420-0.510)."""
    from posttrain.policy.vllm_server import WeightSync

    m = _benchmark_module("vllm_sync")
    syncs = [
        WeightSync(1, 8, 0.3, 0.2, 0.01),
        WeightSync(2, 8, 0.1, 0.4, 0.01),
        WeightSync(3, 8, 0.2, 0.2, 0.02),
    ]
    assert m.cell(syncs, "save_s") == "0.200 (0.100-0.300)"
    assert m.cell(syncs, "total_s") == "0.510 (0.420-0.510)"
    assert m.model_spec("tiny-10m-h64").head_dim == 64  # served by vLLM's CPU attention


@pytest.mark.usefixtures("one_thread")
def test_real_size_run_quick_reports_the_plan_beside_the_measured_peak():
    """One rank of the quick SFT configuration in this process (tiny-1m, no process group): the
    report holds both peaks, positive, and their ratio; the tensor peak of the measured step
    holds at least the fp32 gradients (4 bytes per parameter, counted here)."""
    import dataclasses

    from posttrain.models import build_model, get_preset
    from posttrain.train.memory_plan import MemoryBatch, plan_memory

    bench = _benchmark_module("real_size_run")
    cfg = dataclasses.replace(bench.QUICK[0], plan={}, steps=1)
    report = bench.compare(cfg, [bench.run_rank(0, 1, cfg)])
    assert {"measured_peak", "planned_peak", "ratio", "measured_build", "planned_build"} <= set(
        report
    )
    assert report["measured_peak"] > 0 and report["planned_peak"] > 0
    assert report["ratio"] == report["planned_peak"] / report["measured_peak"]
    spec = get_preset("tiny-1m")
    grads = 4 * sum(p.numel() for p in build_model(spec, seed=0).parameters())
    assert report["measured_tensor_peak"] >= grads
    batch = MemoryBatch(micro_batch_size=cfg.batch, seq_len=cfg.seq_len)
    planned = plan_memory(
        spec, None, batch, optimizer="sgd", device_type="cpu", loss_chunk_tokens=cfg.chunk
    )
    assert report["planned_peak"] == planned.attrs["peak_bytes"]
    assert len(report["step_s_range"]) == 2 and report["step_s"] > 0


def test_sft_packed_counts_the_tokens_and_span_the_trainer_counts():
    """The packed comparison's per-step work (trained tokens) and attention span, counted from
    its documents, equal what posttrain's packed loader batches hold (labels; the span of
    `posttrain.core.timing.attention_span`), and its rows are the loader's rows: the report's
    tokens/s and MFU count what the Trainer trains."""
    from posttrain.core.timing import attention_span

    m = _benchmark_module("sft_packed")
    setup = m.PackedSetup(
        rows=2, seq_len=48, min_len=5, max_len=30, warmup=1, steps=2, pairs=1, threads=1
    )
    docs = m.make_documents(setup, 40)
    assert {len(d) for d in docs} <= set(range(5, 31)) and len({len(d) for d in docs}) > 5
    samples, steps = m.plan_steps(docs, setup)
    loader = m.SFTLoader(
        samples, batch_size=2, shuffle=False, pack=True, seq_len=48, pad_id=m.ByteTokenizer.PAD
    )
    for k in range(setup.warmup + setup.steps):
        batch = loader.next_batch()
        trained_BT = batch.labels != -100
        assert steps.trained(k) == int(trained_BT.sum())
        assert steps.span(k) == int(attention_span(batch.position_ids, trained_BT))
        rows = m._row_docs(steps, k)
        assert len(rows) == batch.input_ids.shape[0]
        for row, row_docs in zip(batch.input_ids.tolist(), rows):
            tokens = [t for d in row_docs for t in d]
            assert row[: len(tokens)] == tokens
