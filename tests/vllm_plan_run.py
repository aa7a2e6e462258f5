"""One rank of tests/rl/test_vllm_plan.py (GRPO with rollout_engine="vllm" under a ParallelPlan
of 2 gloo ranks); run as a subprocess.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=PORT python tests/vllm_plan_run.py RANK 2 OUT PHASES

PHASES, comma-separated:
  * "fake": the stand-in server of tests/_vllm_fake.py (no vLLM needed, seconds): under
    dp_shard=2, 3 steps whose third sync rank 0's server refuses (`fail_reload`, touched after
    step 2); under tp=2, 2 steps whose second rollout request the server refuses (`fail_500`,
    touched after step 1): what each rank saw and raised;
  * "real=URL": the real vLLM server running at URL (the test session's shared tiny-1m server),
    attached by rank 0 (`rollout_options={"url": URL}`: no server start in the ranks), under
    dp_shard=2, 2 steps; after each step every rank syncs the server to the new weights and
    compares greedy tokens of its own prompts, served and sampled by the gathered weights'
    builtin generator.
  * "recipe=URL": the grpo recipe (`recipes/grpo.py` main, its TINY size) under dp_shard=2 with
    `rollout.engine=vllm rollout.url=URL` (a stand-in server the test started): the results and
    the rollouts' weight versions.

Results go to OUT/rank{RANK}.pt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from _policy_helpers import drawn_policy
from _ranks import gloo_rank
from _rl_helpers import ToyTask
from _vllm_fake import fake_venv

from posttrain.rl import RLAlgorithm, RLTrainer
from posttrain.train import ParallelPlan

GREEDY_TOKENS = 6


def trainer_under(plan: ParallelPlan, run_dir: Path, callbacks=(), **options: Any) -> RLTrainer:
    """GRPO (group 4, no KL) of the drawn tiny-1m policy under `plan`, SGD lr 0.1, 4 prompts x 4
    tokens per step, sampled by the vllm engine with `options`."""
    policy = drawn_policy(0)
    runtime = plan.parallelize(policy.model, spec=policy.spec)
    return RLTrainer(
        policy,
        torch.optim.SGD(policy.model.parameters(), lr=0.1),
        task=ToyTask(),
        algo=RLAlgorithm.grpo(group_size=4, kl_coef=0.0),
        prompts_per_step=4,
        max_new_tokens=4,
        micro_batch_size=4,
        progress=False,
        runtime=runtime,
        run_dir=run_dir,
        rollout_engine="vllm",
        rollout_options=options if "url" in options else {"startup_timeout_s": 600.0, **options},
        callbacks=list(callbacks),
    )


def step_record(trainer: RLTrainer) -> dict[str, Any]:
    """The step's groups as (group id, weight versions, first token of each sample), and the
    engine's role and address on this rank."""
    engine = trainer.rollout.engine
    return {
        "groups": [
            (
                next(iter(g)).group_id,
                [t.policy_version for t in g],
                [t.completion_ids[0] for t in g],
            )
            for g in trainer.last_groups or []
        ],
        "url": engine.url,
        "owner": engine.owner is not None,
        "pgid": engine.owner.server.pgid if engine.owner is not None else None,
        "attached": engine.owner.server.attached if engine.owner is not None else None,
    }


def fit_until_refused(trainer: RLTrainer, steps: int, rank: int) -> dict[str, Any]:
    """`trainer.fit(steps)` with each step recorded; what it raised (type, message)."""
    seen: list[dict] = []
    trainer.callbacks.append(lambda t, row: seen.append(step_record(t)))
    try:
        trainer.fit(steps)
        raised = None
    except Exception as err:  # noqa: BLE001 - the refusal under test, reported to the test
        raised = (type(err).__name__, str(err))
    return {
        "steps": seen,
        "raised": raised,
        "step_count": trainer.step_count,
        "engine_after": trainer.rollout.engine,
    }


def fake_phase(rank: int, out: Path) -> dict[str, Any]:
    venv = str(fake_venv(out / "fake-venv"))

    def touch_after(step: int, name: str, run_dir: Path):
        def callback(t: RLTrainer, row: dict) -> None:
            if t.step_count == step and rank == 0:
                (run_dir / "vllm" / name).touch()

        return callback

    results = {}
    for key, plan, step, control, steps in (
        ("dp_shard2", ParallelPlan(dp_shard=2), 2, "fail_reload", 3),
        ("tp2", ParallelPlan(tp=2), 1, "fail_500", 2),
    ):
        run_dir = out / f"fake-{key}"
        trainer = trainer_under(plan, run_dir, [touch_after(step, control, run_dir)], venv=venv)
        results[key] = fit_until_refused(trainer, steps, rank)
    return results


def real_phase(rank: int, out: Path, url: str) -> dict[str, Any]:
    greedy: list[dict] = []

    def compare_greedy(t: RLTrainer, row: dict) -> None:
        """Sync the server to the weights of this update (a collective) and sample greedily
        from it and from the gathered weights' builtin generator."""
        engine = t.rollout.sampler(t.gathered_policy(), t.step_count)
        prompts = [f"{rank}{i}+{7 * i}=" for i in range(3)]
        served = engine.generate(prompts, temperature=0.0, max_new_tokens=GREEDY_TOKENS, seed=0)
        builtin = t.rollout_policy.generate(
            prompts, temperature=0.0, max_new_tokens=GREEDY_TOKENS, seed=0
        )
        greedy.append(
            {
                "served": [list(c.token_ids) for c in served],
                "builtin": [list(c.token_ids) for c in builtin],
                "versions": [c.weight_version for c in served],
            }
        )

    trainer = trainer_under(ParallelPlan(dp_shard=2), out / "real", [compare_greedy], url=url)
    result = fit_until_refused(trainer, 2, rank)
    metrics = trainer.metrics
    result["rows"] = metrics.to_dict("records")
    result["greedy"] = greedy
    return result


def recipe_phase(rank: int, out: Path, url: str) -> dict[str, Any]:
    from posttrain import cli
    from posttrain.core.metrics import read_metrics
    from posttrain.workflows import override

    module = cli.load_recipe("grpo")
    planned = {"parallel.dp_shard": 2, "eval.every": 0, "baseline.steps": 0}
    rollout = {"rollout.engine": "vllm", "rollout.url": url, "out_dir": str(out / "recipe")}
    cfg = override(module.Config(), {**module.TINY, **planned, **rollout})
    results = module.main(cfg)
    rows = read_metrics(out / "recipe").to_dict("records") if results is not None else None
    return {"results": results, "metrics": rows}  # rank 0 writes the run's files


def main() -> None:
    with gloo_rank(timeout_s=900.0) as args:  # rank 1 waits while rank 0 starts the server
        results = {}
        for phase in (args.phase or "").split(","):
            name, _, url = phase.partition("=")
            if name == "fake":
                results[name] = fake_phase(args.rank, args.out)
            else:
                run = {"real": real_phase, "recipe": recipe_phase}[name]
                results[name] = run(args.rank, args.out, url)
        torch.save(results, args.out / f"rank{args.rank}.pt")


if __name__ == "__main__":
    main()
