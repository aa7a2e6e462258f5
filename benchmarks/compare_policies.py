"""Score two saved policies on a recipe's held-out items, paired: greedy accuracy, sampled pass@1
and pass@k, and B minus A with paired-bootstrap 95% intervals.

The held-out items, scorer, answer length and sampling seed are those of the RL recipe's own
evaluation (`posttrain.workflows.rl`), so a policy trained another way (e.g. the "more SFT"
baseline: `posttrain run sft model.init_from=<run>/sft/policy ...`) is compared with the RL run's
start and result on the same footing.

    python benchmarks/compare_policies.py --config recipes/presets/grpo_spell_backward.yaml \\
        runs/grpo_spell_backward/sft/policy runs/more_sft/policy
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy_a", type=Path, help="HF policy folder (the reference side)")
    parser.add_argument("policy_b", type=Path, help="HF policy folder (the compared side)")
    parser.add_argument("--config", help="a grpo recipe preset (YAML); default: the main job")
    parser.add_argument("overrides", nargs="*", default=[], help="dotted key=value overrides")
    parser.add_argument("--out", type=Path, help="write the comparison here as JSON")
    args = parser.parse_args(argv)

    from posttrain import cli
    from posttrain.policy import Policy
    from posttrain.rewards.evaluation import evaluate_sampled, paired_bootstrap_diff
    from posttrain.workflows.recipes import apply_overrides
    from posttrain.workflows.sft import evaluate, held_out_items

    module = cli.load_recipe("grpo")
    cfg = module.Config()
    if args.config:
        cfg = cli.load_config_file(cfg, args.config)
    cfg = apply_overrides(cfg, args.overrides)
    items, scorer = held_out_items(cfg.task)
    scored = {}
    for side, folder in (("a", args.policy_a), ("b", args.policy_b)):
        policy = Policy.from_pretrained(folder)
        greedy = evaluate(policy, items, scorer, max_new_tokens=cfg.eval.max_new_tokens)
        sampled = evaluate_sampled(
            policy,
            items,
            samples=cfg.eval.samples,
            seed=cfg.seed + 1,
            max_new_tokens=cfg.eval.max_new_tokens,
            score_fn=lambda t, it: scorer.score_answer(t.strip(), it),
        )
        scored[side] = (greedy, sampled)
        print(
            f"{side}: {folder}: greedy {greedy.accuracy:.3f}, sampled pass@1 "
            f"{sampled.pass_at_1:.4f}, pass@{sampled.k} {sampled.pass_at_k:.3f}",
            flush=True,
        )
    (ga, sa), (gb, sb) = scored["a"], scored["b"]
    out = {
        "items": len(items),
        "task": cfg.task.name,
        "a": str(args.policy_a),
        "b": str(args.policy_b),
        "greedy": {
            "a": ga.accuracy,
            "b": gb.accuracy,
            "b_minus_a": paired_bootstrap_diff(
                gb.table["correct"].to_numpy(), ga.table["correct"].to_numpy(), seed=cfg.seed
            ),
        },
        "sampled_pass_at_1": {
            "a": sa.pass_at_1,
            "b": sb.pass_at_1,
            "b_minus_a": paired_bootstrap_diff(sb.per_item_pass1, sa.per_item_pass1, seed=cfg.seed),
        },
        f"pass_at_{sa.k}": {"a": sa.pass_at_k, "b": sb.pass_at_k},
    }
    print(json.dumps(out, indent=1, default=float))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
