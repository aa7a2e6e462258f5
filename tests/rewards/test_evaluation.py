import pytest

from posttrain.rewards import evaluate_generations, wilson_interval


def test_wilson_interval_hand_values():
    """5/10: centre (0.5 + 1.92/10)/1.384 = 0.5, half 1.96*sqrt(0.025 + 0.0096)/1.384 = 0.2634.
    0/500: upper bound z^2 / (n + z^2) = 3.8415 / 503.8415 = 0.007624."""
    low, high = wilson_interval(5, 10)
    assert low == pytest.approx(0.2366, abs=1e-4) and high == pytest.approx(0.7634, abs=1e-4)
    low, high = wilson_interval(0, 500)
    assert low == pytest.approx(0.0, abs=1e-12) and high == pytest.approx(0.007624, abs=1e-6)


def test_wilson_interval_rejects_bad_counts():
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(3, 2)
    with pytest.raises(ValueError):
        wilson_interval(0, 0)


class _EchoPolicy:
    """Answers each chat prompt with the last 2 characters of the question (a scripted policy)."""

    class tokenizer:
        @staticmethod
        def render_prompt(messages):
            return messages[0]["content"]

    class model:
        training = True

        @staticmethod
        def train(mode):
            _EchoPolicy.model.training = mode

    def generate(self, prompts, **kwargs):
        from types import SimpleNamespace

        return [
            SimpleNamespace(prompt_index=i, text=p[-2:], finish_reason="eos")
            for i, p in enumerate(prompts)
        ]


def test_accuracy_counts_scored_items_across_batches():
    items = [{"question": f"q{i:02d}", "answer": f"{i:02d}" if i % 3 else "xx"} for i in range(10)]
    result = evaluate_generations(
        _EchoPolicy(),
        items,
        batch_size=4,
        score_fn=lambda text, item: float(text == item["answer"]),
    )
    # items 0, 3, 6, 9 have answer "xx": 6 of 10 correct
    assert result.num_items == 10 and result.accuracy == pytest.approx(0.6)
    assert result.table["correct"].tolist() == [i % 3 != 0 for i in range(10)]
    assert _EchoPolicy.model.training is True


def test_bad_items_raise():
    with pytest.raises(ValueError, match="empty"):
        evaluate_generations(_EchoPolicy(), [], score_fn=lambda t, i: 1.0)
    with pytest.raises(ValueError, match="item 1 has no string 'question'"):
        evaluate_generations(
            _EchoPolicy(), [{"question": "a"}, {"q": 1}], score_fn=lambda t, i: 1.0
        )


class _SeededPolicy(_EchoPolicy):
    """Answer r of a call (0-based over the call's prompts) is "ok" when (seed + r) % period
    == 0: a scripted sampler whose right answers are known in advance."""

    def __init__(self, period):
        self.period = period

    def generate(self, prompts, seed=0, **kwargs):
        from types import SimpleNamespace

        return [
            SimpleNamespace(
                prompt_index=r,
                finish_reason="eos",
                text="ok" if (seed + r) % self.period == 0 else "no",
            )
            for r in range(len(prompts))
        ]


@pytest.mark.parametrize(
    "period, per_item, pass_k",
    [
        # 4 items x 3 samples in one call, seed 1: rows r = sample * 4 + item are right when
        # (1 + r) % period == 0. period 3: rows 2, 5, 8, 11 = items 2, 1, 0, 3, one sample each.
        (3, [1 / 3, 1 / 3, 1 / 3, 1 / 3], 1.0),
        # period 4: rows 3, 7, 11 = item 3 in every sample
        (4, [0.0, 0.0, 0.0, 1.0], 0.25),
    ],
)
def test_sampled_pass_at_1_and_pass_at_k_by_hand(period, per_item, pass_k):
    from posttrain.rewards import evaluate_sampled

    items = [{"question": f"q{i}", "answer": "ok"} for i in range(4)]
    result = evaluate_sampled(
        _SeededPolicy(period),
        items,
        samples=3,
        seed=1,
        score_fn=lambda text, item: float(text == item["answer"]),
    )
    assert result.per_item_pass1.tolist() == pytest.approx(per_item)
    assert result.pass_at_1 == pytest.approx(sum(per_item) / 4) and result.pass_at_k == pass_k
    assert result.k == 3 and result.num_items == 4 and len(result.table) == 12
    assert result.table["item"].tolist() == [0, 1, 2, 3] * 3


@pytest.mark.parametrize(
    "options, word", [({"samples": 0}, "samples"), ({"temperature": 0.0}, "temperature")]
)
def test_sampled_evaluation_rejects_bad_options(options, word):
    from posttrain.rewards import evaluate_sampled

    with pytest.raises(ValueError, match=word):
        evaluate_sampled(
            _SeededPolicy(2), [{"question": "q"}], score_fn=lambda t, i: 1.0, **options
        )
