"""Benchmark models from Hugging Face ``transformers``, built from a tiny config (random weights,
nothing downloaded), next to the project's own ``zoo``.

A real architecture brings what hand-written models miss: its own parameter layout (RMSNorm
weights without biases, separate q/k/v projections, a gated MLP), a tied input/output embedding
read first by forward and produced last by backward, and the library's own forward code.  The
wrapper returns the logits, so the benchmark's language-model loss applies as to ``zoo.gpt``.
"""
from __future__ import annotations

from typing import Any

#: name -> what it is, for messages
MODELS = {"hf_llama": "transformers LlamaForCausalLM (tied embedding, RMSNorm, SwiGLU, rotary)"}


def is_hf(model: str) -> bool:
    return model.lower() in MODELS


def build(model: str, *, vocab: int = 4096, ctx: int = 128, d: int = 256, layers: int = 4,
          heads: int = 8, ffn: int = 688, **unused: Any) -> Any:
    """``model`` with the given sizes; ``seq_len`` (read by the benchmark) is ignored here."""
    import torch
    import transformers

    unknown = set(unused) - {"seq_len"}
    if unknown:
        raise ValueError(f"{model}: unknown option(s) {', '.join(sorted(unknown))}; known: "
                         "vocab, ctx, d, layers, heads, ffn, seq_len")
    if model.lower() != "hf_llama":
        raise ValueError(f"unknown transformers model {model!r}; choose one of {', '.join(MODELS)}")
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=ctx,
        tie_word_embeddings=True, attention_dropout=0.0)
    config._attn_implementation = "eager"

    class Logits(torch.nn.Module):
        """``LlamaForCausalLM`` returning its logits (the benchmark computes the loss)."""

        def __init__(self) -> None:
            super().__init__()
            self.lm = transformers.LlamaForCausalLM(config)

        def forward(self, ids: Any) -> Any:
            return self.lm(input_ids=ids, use_cache=False).logits

    return Logits()
