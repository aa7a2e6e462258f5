"""The multi-turn Python-tool environment sampled by the vLLM engine: a tool call, its output,
the next turn. A tiny-1m policy is fine-tuned for a few seconds to open its turn with a call
(`<python>x</python>`: a NameError traceback comes back), the shared `vllm_server` is synced
with it, and the episode sampled greedily by the server equals the builtin engine's
(`Policy.generate`) on the same fp32 weights: same tokens and masks, each turn's log-probs
equal to the builtin ones and to the policy's teacher-forced recomputation of the whole
transcript (1e-4), the tool turn masked out with log-prob 0.0."""

import pytest
import torch
from _vllm_helpers import SharedServerEngine

from posttrain.envs.python_tool_env import PythonToolGroupBuilder
from posttrain.policy import Policy
from posttrain.rl import collect_groups
from posttrain.verifiers.sandbox import SandboxLimits, sandbox_available

NO_SANDBOX = sandbox_available()
pytestmark = [
    pytest.mark.skipif(NO_SANDBOX is not None, reason=f"no sandbox here: {NO_SANDBOX}"),
    pytest.mark.usefixtures("one_thread"),
]
TOOL = SandboxLimits(cpu_s=1.0, wall_s=60.0, memory_mb=256, output_bytes=65_536)
CALL = "<python>x</python>"
BUILDER = PythonToolGroupBuilder(
    {"question": "2+3", "answer": "5"}, limits=TOOL, max_turns=2, system_prompt=None
)


def _tool_caller(max_steps: int = 300) -> Policy:
    """tiny-1m trained (AdamW, lr 5e-3) on the first assistant turn `CALL` until its greedy
    turn is exactly `CALL` then the end token (~60 steps, a few seconds)."""
    policy = Policy.from_spec("tiny-1m", seed=0)
    messages = BUILDER.make_envs(1)[0].initial_messages()
    rendered = policy.tokenizer.render_chat([*messages, {"role": "assistant", "content": CALL}])
    ids_BT = torch.tensor([rendered.input_ids])
    mask_BT = torch.tensor([rendered.loss_mask])
    prompt = policy.tokenizer.render_prompt(messages)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=5e-3)
    for step in range(1, max_steps + 1):
        logprobs_BT = policy.logprobs_tensor(ids_BT, torch.ones_like(mask_BT), mask_BT)
        loss = -(logprobs_BT * mask_BT).sum() / mask_BT.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0:
            [turn] = policy.generate([prompt], max_new_tokens=24, temperature=0.0)
            if turn.text == CALL and turn.finish_reason == "eos":
                return policy
    raise AssertionError(f"tiny-1m did not learn to write {CALL!r} in {max_steps} steps")


def test_a_tool_calling_episode_sampled_by_vllm_equals_the_builtin_engine(vllm_server):
    policy = _tool_caller()
    options = dict(group_size=2, max_new_tokens=24, temperature=0.0, seed=0)
    built = collect_groups(policy, [BUILDER], **options)[0].trajectories
    with SharedServerEngine(vllm_server) as engine:
        version = engine.sync(policy)
        served = collect_groups(engine, [BUILDER], **options)[0].trajectories
    tokenizer = policy.tokenizer
    for b, v in zip(built, served):
        assert v.policy_version == version
        assert v.info["turn"] == 2 and v.info["counts"]["calls"] >= 1  # a call, then a turn
        assert v.text.startswith(CALL)
        assert (v.prompt_ids, v.completion_ids, v.completion_mask, v.text, v.outcome) == (
            b.prompt_ids,
            b.completion_ids,
            b.completion_mask,
            b.text,
            b.outcome,
        )
        sampled = [i for i, m in enumerate(v.completion_mask) if m]
        tool = [i for i, m in enumerate(v.completion_mask) if not m]
        first = len(tokenizer.encode(CALL)) + 1  # the first turn and its end token
        assert sampled[:first] == list(range(first)) and len(sampled) > first  # two turns
        assert tool == list(range(first, tool[-1] + 1))  # one span between them
        told = tokenizer.decode([v.completion_ids[i] for i in tool])
        assert "<output>Traceback" in told and "NameError: name 'x' is not defined" in told
        assert all(v.logprobs[i] == 0.0 == b.logprobs[i] for i in tool)
        # greedy turns' log-probs are the untempered model's, in both engines and here
        [recomputed] = policy.logprobs([v.prompt_ids], [v.completion_ids])
        for name, reference in (("builtin", b.logprobs), ("recomputed", recomputed.tolist())):
            gap = max(abs(v.logprobs[i] - reference[i]) for i in sampled)
            assert gap < 1e-4, (name, gap)
