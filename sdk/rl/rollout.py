"""Rollouts: sample a group of G completions per prompt with a `Policy`, play the environments,
and return scored `Group`s of token-level `Trajectory`s.

Notation: G = group size (completions per prompt), P = prompt tokens, C = completion tokens.

One call, `collect_groups`, does for a batch of `EnvGroupBuilder`s:

    envs      = builder.make_envs(G) for each builder
    prompts   = tokenizer.render_prompt(env.initial_messages())
    turn 1    = ONE batched `policy.generate(prompts, n=G)` (one prompt per group)
    step      = env.step(completion text)  -> done (reward, typed verifier outcome) or observation
    turn k>1  = multi-turn envs only: observation tokens are appended to the context with
                completion_mask False and logprob 0.0, then one batched generate for every
                still-running episode (n=1 each)
    rewards   = `group_rewards(builder, trajectories)` (the builder's group hook, if any)

Failures are data, never a crash and never a silent 0.0 (DESIGN.md): an environment that raises
in `step`, a group hook that raises or returns a non-finite reward, or an episode that is not done
after `max_turns` gives the trajectory outcome "error" (reward 0.0, `info["error"]` says why);
verifier timeouts and errors arrive as the verifier's own typed outcomes ("timeout", "error").
An empty completion (the policy stops at once) is scored like any other text. The trainer
decides what to do with each outcome (`posttrain.rl.trainer`); `outcome_counts` counts them.

Example (a fresh tiny policy on two chain_sum prompts):
    >>> from posttrain.policy import Policy
    >>> from posttrain.envs import chain_sum_task
    >>> policy = Policy.from_spec("tiny-1m", seed=0)
    >>> builders = chain_sum_task(size=8, held_out_size=2).builders(0, 2)
    >>> groups = collect_groups(policy, builders, group_size=4, max_new_tokens=4, seed=0)
    >>> [len(g) for g in groups], sum(outcome_counts(groups).values())
    ([4, 4], 8)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from posttrain.core.checks import check_int, check_number
from posttrain.rewards.verifier import Outcome
from posttrain.rl.environment import EnvGroupBuilder, Environment, Group, Trajectory, group_rewards

__all__ = [
    "EXCLUDED_OUTCOMES",
    "REWARD_TERMS",
    "REWARD_TERM_FAILURES",
    "collect_filtered",
    "collect_groups",
    "outcome_counts",
    "overlong_penalty",
    "reward_term_metrics",
    "rollout_metrics",
]

EXCLUDED_OUTCOMES = frozenset({"error", "timeout"})
"""Outcomes that exclude their whole group from the update (see `posttrain.rl.trainer`)."""

REWARD_TERMS = "reward_terms"
"""`Trajectory.info` key of a `{name: reward or None}` dict: each reward function's own value
(`posttrain.envs.prompt_task`), summarised per step as `reward/<name>` by `rollout_metrics`."""
REWARD_TERM_FAILURES = "reward_term_failures"
"""`Trajectory.info` key of the names of the reward functions that failed on it."""

_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


@dataclass
class _Episode:
    """One running episode: the token context so far and what the policy sampled in it."""

    group: int
    env: Environment
    messages: list[dict]
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    reward: float = 0.0
    outcome: str = Outcome.OK.value
    finish_reason: str = "stop"
    info: dict = field(default_factory=dict)
    done: bool = False
    versions: list[int] = field(default_factory=list)  # of the turns' samples, when stamped
    turn_tokens: list[int] = field(default_factory=list)  # tokens sampled in each turn

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def fail(self, reason: str, finish_reason: str = "error") -> None:
        self.done, self.reward, self.outcome = True, 0.0, Outcome.ERROR.value
        self.finish_reason = finish_reason
        self.info["error"] = reason


def collect_groups(
    policy,
    builders: Sequence[EnvGroupBuilder],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    policy_version: int = 0,
    verifier_timeout_s: float | None = None,
    max_turns: int = 8,
    overlong_buffer_len: int = 0,
    overlong_penalty_factor: float = 1.0,
) -> list[Group]:
    """Sample `group_size` episodes per builder and return one scored `Group` per builder.

    Args:
        policy: a `posttrain.policy.policy.Policy` or a `RolloutEngine`
            (`posttrain.policy.rollout_engine`): its tokenizer renders the messages.
        builders: one `EnvGroupBuilder` per prompt; group i gets `group_id` i.
        group_size: G, environments (and completions) per builder.
        max_new_tokens: most tokens sampled per assistant turn.
        temperature, top_p: sampling settings; the trajectories' `logprobs` are under exactly
            this distribution (`posttrain.policy.sampling.sampling_logprobs`), so the trainer
            must score with the same settings.
        seed: turn k samples with seed `seed + k` (same seed, same weights -> same groups).
        policy_version: stored on each trajectory (optimizer steps of the sampling policy);
            a completion stamped with its `weight_version` (a `RolloutEngine`'s) gives that
            instead, the oldest of its turns'.
        verifier_timeout_s: if given, set as `timeout_s` on every environment that has that
            attribute (the reasoning-gym and calculator environments pass it to `run_verifier`).
        max_turns: safety net for multi-turn environments without a turn limit of their own.
        overlong_buffer_len, overlong_penalty_factor: DAPO's soft overlong punishment, added
            to every judged trajectory's reward (`overlong_penalty` of its longest turn; kept
            in `info["overlong_penalty"]`); buffer 0: off.

    Returns:
        `len(builders)` groups of G trajectories each, in builder order.

    Raises:
        ValueError: for `group_size` < 1, no builders, or a prompt too long for the model.
    """
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size={group_size!r}; must be an integer >= 1")
    if len(builders) == 0:
        raise ValueError("builders is empty; pass at least one EnvGroupBuilder")
    # the overlong settings are checked before any sampling (the penalty of a full-length turn)
    overlong_penalty(max_new_tokens, max_new_tokens, overlong_buffer_len, overlong_penalty_factor)
    tokenizer = policy.tokenizer
    episodes: list[_Episode] = []
    for g, builder in enumerate(builders):
        envs = builder.make_envs(group_size)
        if len(envs) != group_size:
            raise ValueError(
                f"{type(builder).__name__}.make_envs({group_size}) returned "
                f"{len(envs)} environments"
            )
        for env in envs:
            if verifier_timeout_s is not None and hasattr(env, "timeout_s"):
                env.timeout_s = verifier_timeout_s
            messages = list(env.initial_messages())
            episodes.append(_Episode(g, env, messages, list(tokenizer.render_prompt(messages))))

    sample = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    for turn in range(max_turns):
        running = [e for e in episodes if not e.done]
        if not running:
            break
        same_prompt = turn == 0 and all(
            episodes[i].prompt_ids == episodes[i - i % group_size].prompt_ids
            for i in range(len(episodes))
        )
        if same_prompt:  # the usual single-turn case: n = G samples of each group's prompt
            prompts = [episodes[g * group_size].prompt_ids for g in range(len(builders))]
            completions = policy.generate(prompts, n=group_size, seed=seed + turn, **sample)
        else:
            completions = policy.generate([e.context for e in running], seed=seed + turn, **sample)
        for episode, completion in zip(running, completions):
            _play(episode, completion, tokenizer, policy.spec.max_seq_len)
    for episode in episodes:
        if not episode.done:
            episode.fail(f"not done after max_turns={max_turns} turns", finish_reason="max_turns")

    groups = []
    for g, builder in enumerate(builders):
        members = episodes[g * group_size : (g + 1) * group_size]
        trajectories = [_trajectory(e, policy_version) for e in members]
        try:
            rewards = group_rewards(builder, trajectories)
        except Exception as e:  # noqa: BLE001 - a broken group hook fails its group, not the run
            rewards = [0.0] * len(trajectories)
            for t in trajectories:
                t.outcome = Outcome.ERROR.value
                t.info["error"] = f"group_rewards: {type(e).__name__}: {e}"
        for member, t, r in zip(members, trajectories, rewards):
            t.reward = float(r)
            if overlong_buffer_len and t.outcome not in EXCLUDED_OUTCOMES:
                penalty = overlong_penalty(
                    max(member.turn_tokens, default=0),
                    max_new_tokens,
                    overlong_buffer_len,
                    overlong_penalty_factor,
                )
                t.reward += penalty
                t.info["overlong_penalty"] = penalty
        groups.append(Group(trajectories))
    return groups


def _play(episode: _Episode, completion, tokenizer, max_seq_len: int) -> None:
    """Record one sampled assistant turn, step the environment, append its observation."""
    episode.completion_ids += completion.token_ids
    episode.logprobs += completion.logprobs
    episode.mask += [True] * len(completion.token_ids)
    episode.texts.append(completion.text)
    episode.turn_tokens.append(len(completion.token_ids))
    if getattr(completion, "weight_version", None) is not None:
        episode.versions.append(completion.weight_version)
    episode.finish_reason = _FINISH[completion.finish_reason]
    episode.messages.append({"role": "assistant", "content": completion.text})
    try:
        result = episode.env.step(completion.text)
    except Exception as e:  # noqa: BLE001 - a failing environment (or NaN reward) fails its episode only
        episode.fail(f"{type(episode.env).__name__}.step raised {type(e).__name__}: {e}")
        return
    info = dict(result.info)
    if result.verifier_result is not None and result.verifier_result.reason:
        info["verifier_reason"] = result.verifier_result.reason
    episode.info.update(info)
    if result.done:
        assert result.reward is not None, "StepResult refuses done=True without a reward"
        episode.done, episode.reward, episode.outcome = True, float(result.reward), result.outcome
        return
    # Multi-turn: the tokens the chat template puts after this assistant turn and the
    # observation, appended as context (not trained). Whatever closes the assistant turn
    # (e.g. <|end|> when the turn was cut by the length limit) comes with them.
    before = tokenizer.render_chat(episode.messages[:-1], add_generation_prompt=True).input_ids
    turn_ids = tokenizer.render_chat(episode.messages).input_ids[len(before) :]
    episode.messages += list(result.observation or [])
    after = tokenizer.render_prompt(episode.messages)
    sampled = completion.token_ids
    closing = (
        []
        if sampled and sampled[-1] in tokenizer.stop_ids
        else turn_ids[len(tokenizer.encode(completion.text)) :]
    )
    observation_ids = list(closing) + list(after[len(before) + len(turn_ids) :])
    episode.completion_ids += observation_ids
    episode.logprobs += [0.0] * len(observation_ids)
    episode.mask += [False] * len(observation_ids)
    if len(episode.context) >= max_seq_len:
        episode.done, episode.reward = True, 0.0
        episode.outcome, episode.finish_reason = Outcome.FORMAT_ERROR.value, "length"
        episode.info["error"] = f"context reached max_seq_len={max_seq_len} before an answer"


def _trajectory(episode: _Episode, policy_version: int) -> Trajectory:
    multi_turn = not all(episode.mask)
    return Trajectory(
        group_id=episode.group,
        prompt_ids=episode.prompt_ids,
        completion_ids=episode.completion_ids,
        logprobs=episode.logprobs,
        reward=episode.reward,
        outcome=episode.outcome,
        finish_reason=episode.finish_reason,
        text="".join(episode.texts),
        policy_version=min(episode.versions, default=policy_version),
        info=episode.info,
        completion_mask=list(episode.mask) if multi_turn else None,
    )


def overlong_penalty(length: int, max_new_tokens: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", sec. 3.4, eq. 13, as verl's
    `DAPORewardManager` adds it): with L_max = `max_new_tokens` and L_cache = `buffer_len`,
    min(-(length - (L_max - L_cache)) / L_cache * factor, 0): 0 up to L_max - L_cache tokens,
    then falling linearly to -factor at L_max. `length` counts sampled tokens, the stop token
    included. buffer_len 0: 0.0 (off).

    Raises:
        ValueError: buffer_len not an int in [0, max_new_tokens], factor not a finite number
            >= 0, or length not an int in [0, max_new_tokens].

    Example (a 7-token limit with a 2-token buffer):
        >>> [overlong_penalty(n, 7, 2, 1.0) for n in (4, 5, 6, 7)]
        [0.0, 0.0, -0.5, -1.0]
    """
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    check_number("overlong_buffer_len", buffer_len, integer=True, low=0, high=max_new_tokens)
    check_number("overlong_penalty_factor", factor, low=0.0)
    check_number("length", length, integer=True, low=0, high=max_new_tokens)
    if buffer_len == 0:
        return 0.0
    exceed = max(length - (max_new_tokens - buffer_len), 0)
    return -exceed / buffer_len * factor if exceed else 0.0


def outcome_counts(groups: Sequence[Group]) -> dict[str, int]:
    """How many trajectories have each outcome; every `Outcome` value is a key (zeros too)."""
    counts = {o.value: 0 for o in Outcome}
    for group in groups:
        for t in group:
            counts[t.outcome] += 1
    return counts


def rollout_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """The rollout's metrics for one RL step.

    reward_mean over the samples the verifier judged (an error or timeout has no reward: it is
    counted, not averaged in as 0.0; NaN when no sample was judged), accuracy (fraction of all
    samples with outcome ok), outcome counts, lengths, and `env_<name>`: the sum over all
    trajectories of each counter an environment reports in `StepResult.info["counts"]` (a dict
    name -> int, e.g. the Python-tool environment's calls and cut outputs), with reward
    functions the per-function metrics of `reward_term_metrics`, and with DAPO's overlong
    punishment `overlong_penalty`, its mean over the judged samples (included in reward_mean).
    """
    rows = [t for g in groups for t in g]
    counts = outcome_counts(groups)
    judged = [t.reward for t in rows if t.outcome not in EXCLUDED_OUTCOMES]
    sampled = [
        sum(t.completion_mask) if t.completion_mask is not None else len(t.completion_ids)
        for t in rows
    ]
    penalties = [t.info["overlong_penalty"] for t in rows if "overlong_penalty" in t.info]
    env_counts: dict[str, int] = {}
    for t in rows:
        for name, value in (t.info.get("counts") or {}).items():
            env_counts[f"env_{name}"] = env_counts.get(f"env_{name}", 0) + int(value)
    return {
        **reward_term_metrics(rows),
        "reward_mean": sum(judged) / len(judged) if judged else float("nan"),
        "accuracy": counts["ok"] / len(rows),
        **{f"outcome_{k}": v for k, v in counts.items()},
        "response_length": sum(sampled) / len(rows),
        "sampled_tokens": sum(sampled),
        "finish_length_frac": sum(t.finish_reason == "length" for t in rows) / len(rows),
        **env_counts,
        **({"overlong_penalty": sum(penalties) / len(penalties)} if penalties else {}),
    }


def reward_term_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Per-function reward metrics of one step, as TRL's `rewards/<name>/mean`: for each reward
    function named in a trajectory's `info[REWARD_TERMS]`, `reward/<name>` is the mean of its
    own (unweighted) values over the trajectories it scored (None, "not applicable", and
    failures left out; NaN when it scored none) and `reward/<name>/failures` the number of
    trajectories it failed on. {} when no trajectory carries reward terms (a task's verifier).

    Example:
        >>> from posttrain.rl.environment import Trajectory
        >>> def traj(terms, failed=()):
        ...     return Trajectory(group_id=0, prompt_ids=[], completion_ids=[], logprobs=[],
        ...         reward=0.0, outcome="ok", finish_reason="stop", text="",
        ...         info={REWARD_TERMS: terms, REWARD_TERM_FAILURES: list(failed)})
        >>> reward_term_metrics([traj({"acc": 1.0, "len": None}),
        ...                      traj({"acc": 0.0, "len": 0.5}), traj({"acc": None}, ["acc"])])
        {'reward/acc': 0.5, 'reward/acc/failures': 1, 'reward/len': 0.5, 'reward/len/failures': 0}
    """
    values: dict[str, list[float]] = {}
    failures: dict[str, int] = {}
    for t in trajectories:
        for name, value in (t.info.get(REWARD_TERMS) or {}).items():
            values.setdefault(name, [])
            failures.setdefault(name, 0)
            if value is not None:
                values[name].append(value)
        for name in t.info.get(REWARD_TERM_FAILURES) or ():
            failures[name] = failures.get(name, 0) + 1
    out: dict[str, float] = {}
    for name in values:
        kept = values[name]
        out[f"reward/{name}"] = sum(kept) / len(kept) if kept else float("nan")
        out[f"reward/{name}/failures"] = failures[name]
    return out


def collect_filtered(
    collect: Callable[[Sequence[EnvGroupBuilder], int], list[Group]],
    batch: Callable[[int], Sequence[EnvGroupBuilder]],
    *,
    target: int,
    max_batches: int,
) -> tuple[list[EnvGroupBuilder], list[Group], list[Group]]:
    """DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2): sample batch 0, 1, ... of builders
    (`collect(batch(i), i)`) and keep the groups whose rewards are not all equal, until `target`
    are kept or `max_batches` batches were sampled.

    Returns (builders, groups, sampled): the kept builders and groups (at most `target`, in
    sampling order; their group ids renumbered 0, 1, ... so that groups of different batches
    never share one) and every group sampled (for the step's rollout metrics).

    Example (rewards are 1 on batch 0's first prompt only):
        >>> def make(i, rewards):
        ...     return Group([Trajectory(group_id=i, prompt_ids=[1], completion_ids=[2],
        ...                              logprobs=[0.0], reward=r, outcome="ok",
        ...                              finish_reason="stop", text="") for r in rewards])
        >>> collect = lambda builders, i: [make(j, (b, 0.0)) for j, b in enumerate(builders)]
        >>> builders, groups, sampled = collect_filtered(collect, lambda i: [float(i == 0), 0.0],
        ...                                              target=2, max_batches=3)
        >>> builders, [g.group_id for g in groups], len(sampled)
        ([1.0], [0], 6)
    """
    builders: list[EnvGroupBuilder] = []
    groups: list[Group] = []
    sampled: list[Group] = []
    for i in range(max_batches):
        batch_builders = list(batch(i))
        batch_groups = collect(batch_builders, i)
        sampled += batch_groups
        for builder, group in zip(batch_builders, batch_groups):
            if len(groups) < target and len(set(group.rewards)) > 1:
                builders.append(builder)
                groups.append(Group([replace(t, group_id=len(groups)) for t in group]))
        if len(groups) >= target:
            break
    return builders, groups, sampled
