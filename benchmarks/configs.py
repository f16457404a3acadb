"""The small Hugging Face configs the benchmark scripts build models from (random weights)."""

from __future__ import annotations

from typing import Any


def llama() -> Any:
    """The serving issue's Llama: hidden 128, 2 layers, 4 heads, 2 KV heads, vocab 1000."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        intermediate_size=256,
    )
