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

        return [SimpleNamespace(prompt_index=i, text=p[-2:], finish_reason="eos")
                for i, p in enumerate(prompts)]


def test_accuracy_counts_scored_items_across_batches():
    items = [{"question": f"q{i:02d}", "answer": f"{i:02d}" if i % 3 else "xx"} for i in range(10)]
    result = evaluate_generations(_EchoPolicy(), items, batch_size=4,
                                  score_fn=lambda text, item: float(text == item["answer"]))
    # items 0, 3, 6, 9 have answer "xx": 6 of 10 correct
    assert result.num_items == 10 and result.accuracy == pytest.approx(0.6)
    assert result.table["correct"].tolist() == [i % 3 != 0 for i in range(10)]
    assert _EchoPolicy.model.training is True


def test_bad_items_raise():
    with pytest.raises(ValueError, match="empty"):
        evaluate_generations(_EchoPolicy(), [], score_fn=lambda t, i: 1.0)
    with pytest.raises(ValueError, match="item 1 has no string 'question'"):
        evaluate_generations(_EchoPolicy(), [{"question": "a"}, {"q": 1}], score_fn=lambda t, i: 1.0)
