"""Model families (Qwen2, Qwen3 dense, Llama 3, Mistral, and a Qwen2-MoE variant) as specs built
with torchtune, Hugging Face config and weight conversion, and tokenizers (byte-level and
`tokenizer.json`) with chat templates.
"""

from __future__ import annotations

from posttrain.models.chat import ROLES, RenderedChat
from posttrain.models.conversion import ConversionReport
from posttrain.models.hf import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from posttrain.models.hf_config import hf_config_from_spec, spec_from_hf_config
from posttrain.models.hf_tokenizer import (
    FALLBACK_CHAT_TEMPLATE,
    HF_CHAT_TEMPLATE_FILE,
    HF_CONFIG_FILE,
    HF_SPECIAL_TOKENS_FILE,
    HF_TOKENIZER_FILE,
    HFTokenizer,
)
from posttrain.models.lora import (
    adapters_disabled,
    apply_lora,
    has_adapters,
    load_peft_adapter,
    merge_lora,
    save_peft_adapter,
)
from posttrain.models.lora_config import LoRAConfig
from posttrain.models.moe import MoEFeedForward, moe_aux_loss
from posttrain.models.specs import (
    FAMILIES,
    PRESETS,
    ModelSpec,
    RopeScaling,
    build_model,
    get_preset,
)
from posttrain.models.tokenizer import (
    BYTE_TOKENIZER_FILE,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
)

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "GENERATION_CONFIG_NAME",
    "spec_from_hf_config",
    "hf_config_from_spec",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
    "FAMILIES",
    "RopeScaling",
    "ModelSpec",
    "PRESETS",
    "get_preset",
    "build_model",
    "MoEFeedForward",
    "moe_aux_loss",
    "ConversionReport",
    "LoRAConfig",
    "apply_lora",
    "merge_lora",
    "save_peft_adapter",
    "load_peft_adapter",
    "has_adapters",
    "adapters_disabled",
    "ROLES",
    "BYTE_TOKENIZER_FILE",
    "HF_TOKENIZER_FILE",
    "HF_CONFIG_FILE",
    "HF_CHAT_TEMPLATE_FILE",
    "HF_SPECIAL_TOKENS_FILE",
    "FALLBACK_CHAT_TEMPLATE",
    "RenderedChat",
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
]
