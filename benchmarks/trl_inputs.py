"""What TRL is given, in the benchmarks that compare it with posttrain, so that it trains on exactly
what posttrain trains on: the byte tokenizer as a transformers tokenizer with the same ids, a
task's rendered prompts as a `datasets.Dataset` (checked to tokenize back to posttrain's ids), a
check that the transformers model loaded from a saved checkpoint computes posttrain's logits, the
config fields every comparison gives TRL alike (`CPU_ARGS`, `GRPO_ARGS`), its optimizer, and a
callback at the end of each of its optimizer steps.
Used by `grpo_step.py`, `grpo_vs_trl.py` and `sft_throughput.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from posttrain.models import ByteTokenizer

CPU_ARGS: dict[str, Any] = dict(
    use_cpu=True,
    bf16=False,  # TRL's configs default to bf16, ~10x slower on a CPU without bf16 matmul
    fp16=False,
    gradient_checkpointing=False,  # its default True recomputes the forward in backward
    gradient_accumulation_steps=1,
    weight_decay=0.0,
    report_to=[],
    logging_strategy="no",
    save_strategy="no",
    eval_strategy="no",
    disable_tqdm=True,
    dataloader_num_workers=0,
)
"""TRL config fields every comparison sets alike: fp32 on the CPU, no recomputation, one
micro-batch per optimizer step, no weight decay, nothing logged, saved or evaluated, no data
workers."""

GRPO_ARGS: dict[str, Any] = dict(
    steps_per_generation=1,
    num_iterations=1,
    epsilon=0.2,
    loss_type="grpo",
    scale_rewards="group",
    use_vllm=False,
    log_completions=False,
)
"""`GRPOConfig` fields that make TRL's GRPO posttrain's: one generation per optimizer step, one
PPO epoch, clip 0.2, per-sequence token-mean loss, advantages scaled by the group's std,
sampling by the trainer's own `generate`."""


def trl_optimizers(model: torch.nn.Module, lr: float, same_optimizer: bool) -> tuple[Any, Any]:
    """TRL's `optimizers=`: posttrain's plain `torch.optim.AdamW` (weight decay 0) with
    `same_optimizer`, else TRL's default (None, None: `adamw_torch_fused`)."""
    if not same_optimizer:
        return None, None
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0), None


def on_step_end(fn: Callable[[], object]):
    """A transformers `TrainerCallback` that calls `fn()` at the end of every optimizer step."""
    from transformers import TrainerCallback

    class StepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            fn()

    return StepEnd()


def hf_byte_tokenizer():
    """A transformers tokenizer with the byte tokenizer's ids: bytes 0..255 through a ByteLevel BPE
    without merges (id = byte value), the 16 special tokens as added tokens 256..271."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    tok = ByteTokenizer()
    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins, one per byte
    byte_to_char = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    specials = [tok.token_name(i) for i in range(256, tok.vocab_size)]
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    assert [backend.token_to_id(s) for s in specials] == list(range(256, tok.vocab_size))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<|pad|>", eos_token="<|eos|>", bos_token="<|bos|>"
    )


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (what ByteLevel uses), in byte order."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def trl_dataset(task, hf_tok):
    """Rendered prompt texts (+ item index) of every training item; checks TRL's tokenization.

    Returns (a Dataset with columns "prompt" and "idx", the task's training items, each prompt's
    length in tokens); raises AssertionError if `hf_tok` does not encode a prompt text back to
    posttrain's ids."""
    from datasets import Dataset

    tok = ByteTokenizer()
    items = task.train_items
    prompts, lengths = [], []
    for i, item in enumerate(items):
        env = task.make_builder(item).make_envs(1)[0]
        ids = tok.render_prompt(env.initial_messages())
        text = hf_tok.decode(ids, skip_special_tokens=False)
        assert hf_tok(text, add_special_tokens=False).input_ids == ids, (i, text)
        prompts.append(text)
        lengths.append(len(ids))
    return Dataset.from_dict({"prompt": prompts, "idx": list(range(len(items)))}), items, lengths


def check_same_model(tune_model: torch.nn.Module, hf_model: torch.nn.Module) -> float:
    """Max |logit difference| of the two models on 2 rows of 64 random byte ids; raises
    AssertionError above 1e-4."""
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf_model(ids).logits - tune_model(ids)).abs().max().item()
    assert diff < 1e-4, f"transformers and posttrain logits differ by {diff}"
    return diff
