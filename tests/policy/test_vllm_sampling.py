"""The vLLM engine's request mapping and answer parsing (posttrain.policy.vllm_sampling), and
the refusals that happen before any server starts. No server needed: these run everywhere.

The expected request bodies are written out by hand from the mapping table in the module's
docstring (vLLM's completions API fields), not produced by the code under test.
"""

import pytest
import torch

from posttrain.models import ByteTokenizer
from posttrain.policy import Policy
from posttrain.policy.vllm_sampling import (
    ServedCompletion,
    completion_requests,
    encode_prompts,
    served_completion,
)
from posttrain.policy.vllm_server import VLLMServer, VLLMUnavailable

STOP = sorted(ByteTokenizer().stop_ids)


def test_requests_map_every_setting_by_hand():
    bodies = completion_requests(
        [[1, 2, 3], [4]],
        model="m",
        max_seq_len=8,
        stop_ids=[9, 5],
        seed=100,
        n=2,
        max_new_tokens=6,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
    )
    common = {
        "model": "m",
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "stop_token_ids": [5, 9],
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "n": 1,
    }
    # prompt-major; sample j of prompt i has seed 100 + 2 i + j; max_tokens capped at 8 - len.
    assert bodies == [
        {**common, "prompt": [1, 2, 3], "max_tokens": 5, "seed": 100},
        {**common, "prompt": [1, 2, 3], "max_tokens": 5, "seed": 101},
        {**common, "prompt": [4], "max_tokens": 6, "seed": 102},
        {**common, "prompt": [4], "max_tokens": 6, "seed": 103},
    ]


def test_defaults_map_to_vllm_off_values():
    [body] = completion_requests([[1]], model="m", max_seq_len=512, stop_ids=[], seed=0)
    assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"]) == (
        1.0,
        1.0,
        -1,
        64,
    )


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"stop": "\n"}, "stop="),
        ({"stop": ["a", "b"]}, "stop="),
        ({"temperature": -1.0}, "temperature="),
        ({"temperature": float("nan")}, "temperature="),
        ({"top_p": 0.0}, "top_p="),
        ({"top_k": 0}, "top_k="),
        ({"n": 0}, "n="),
        ({"max_new_tokens": 0}, "max_new_tokens="),
    ],
)
def test_bad_or_unsupported_settings_are_refused_by_name(setting, named):
    with pytest.raises(ValueError, match=named):
        completion_requests([[1]], model="m", max_seq_len=8, stop_ids=[], seed=0, **setting)


def test_a_prompt_that_fills_the_context_is_refused():
    with pytest.raises(ValueError, match=r"prompts\[0\] has 8 tokens; max_seq_len=8"):
        completion_requests([[1] * 8], model="m", max_seq_len=8, stop_ids=[], seed=0)


def _answer(token_ids, logprobs, reason="stop"):
    return {
        "choices": [
            {
                "token_ids": token_ids,
                "logprobs": {"token_logprobs": logprobs},
                "finish_reason": reason,
            }
        ]
    }


def test_answers_become_served_completions():
    c = served_completion(
        _answer([7, 8], [-0.5, -1.25]),
        prompt_index=1,
        sample_index=0,
        prompt_ids=[1, 2],
        text="xy",
        weight_version=3,
    )
    assert c == ServedCompletion(
        prompt_index=1,
        sample_index=0,
        prompt_ids=[1, 2],
        token_ids=[7, 8],
        text="xy",
        logprobs=[-0.5, -1.25],
        finish_reason="eos",
        weight_version=3,
    )
    long = served_completion(
        _answer([7], [-0.5], "length"),
        prompt_index=0,
        sample_index=0,
        prompt_ids=[1],
        text="",
        weight_version=0,
    )
    assert long.finish_reason == "length"


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ({"choices": []}, "one choice"),
        (_answer([7], None), "no token_ids or logprobs"),
        (_answer([7, 8], [-1.0]), "2 token ids but 1 log-probs"),
        (_answer([7], [-1.0], "abort"), "finish_reason='abort'"),
        (_answer([7], [float("nan")]), "NaN"),
    ],
)
def test_malformed_answers_raise(answer, message):
    with pytest.raises(ValueError, match=message):
        served_completion(
            answer, prompt_index=0, sample_index=0, prompt_ids=[1], text="", weight_version=0
        )


def test_prompts_are_encoded_with_bos_and_checked():
    tok = ByteTokenizer()
    assert encode_prompts(["ab", [3, 4]], tok, 272) == [[tok.bos_id, 97, 98], [3, 4]]
    for bad in ([], "ab", [[]], [[272]], [[True]], [""]):
        with pytest.raises(ValueError, match="prompt"):
            encode_prompts(bad, tok, 272)


def test_unsupported_architecture_is_refused_before_anything_starts(tmp_path):
    moe = Policy.from_spec("tiny-moe", seed=0)
    with pytest.raises(ValueError, match="serves Qwen2ForCausalLM, LlamaForCausalLM"):
        VLLMServer.start(moe, tmp_path, venv=tmp_path / "no-venv")
    if not torch.cuda.is_available():  # vLLM's CPU attention has no head_dim=40 kernel
        with pytest.raises(ValueError, match="head_dim=40 .* serves head dims 32, 64"):
            VLLMServer.start(Policy.from_spec("tiny-10m", seed=0), tmp_path, venv=tmp_path / "x")
    half = Policy.from_spec("tiny-1m", seed=0, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        VLLMServer.start(half, tmp_path, venv=tmp_path / "no-venv")
    assert not (tmp_path / "vllm").exists()


def test_missing_venv_names_the_script(tmp_path):
    policy = Policy.from_spec("tiny-1m", seed=0)
    with pytest.raises(VLLMUnavailable, match="run scripts/vllm-up.sh"):
        VLLMServer.start(policy, tmp_path, venv=tmp_path / "no-venv")
    assert not (tmp_path / "vllm").exists()
