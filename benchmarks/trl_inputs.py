"""What TRL is given, in the benchmarks that compare it with posttrain, so that it trains on exactly
what posttrain trains on: the byte tokenizer as a transformers tokenizer with the same ids, a
task's rendered prompts as a `datasets.Dataset` (checked to tokenize back to posttrain's ids), and
a check that the transformers model loaded from a saved checkpoint computes posttrain's logits.
Used by `grpo_step.py`, `grpo_vs_trl.py` and `sft_throughput.py`.
"""

from __future__ import annotations

import torch

from posttrain.models import ByteTokenizer


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
