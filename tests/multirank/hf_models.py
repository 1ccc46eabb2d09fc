"""Real architectures from Hugging Face ``transformers``, as tiny configurations (random weights,
nothing downloaded), each with a batch maker whose ``model(**batch).loss`` trains it.

They cover what hand-written test models miss: tied input/output embeddings read by two modules
(GPT-2, Llama, OPT, BERT, T5, BART), parameters of the root or of a parent read before any child
runs or after all of them (ViT's class token and position embeddings, CLIP's ``logit_scale``),
a mixture of experts whose experts are used on some steps only (Mixtral), encoder-decoders
(T5, BART), windowed attention with a relative-position table (Swin), and convolutional networks
with batch norm and layer scales (ResNet, ConvNeXt).  Dropout stays on (``train()``), so both
runs of a comparison must seed the same way (``build`` and ``batches`` do).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import transformers as tf

VOCAB, SEQ, BATCH, IMAGE = 96, 12, 4, 32
HIDDEN = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)


def _tokens(gen: torch.Generator) -> dict:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def _seq2seq(gen: torch.Generator) -> dict:
    return {"input_ids": torch.randint(2, VOCAB, (BATCH, SEQ), generator=gen),
            "labels": torch.randint(2, VOCAB, (BATCH, SEQ // 2), generator=gen)}


def _images(classes: int) -> Callable[[torch.Generator], dict]:
    def make(gen: torch.Generator) -> dict:
        return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen),
                "labels": torch.randint(0, classes, (BATCH,), generator=gen)}
    return make


def _clip_batch(gen: torch.Generator) -> dict:
    return {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
            "pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen),
            "return_loss": True}


@dataclass(frozen=True)
class Arch:
    family: str
    make: Callable[[], torch.nn.Module]
    batch: Callable[[torch.Generator], dict]


def _vision(classes: int = 5) -> dict:
    return dict(num_labels=classes, image_size=IMAGE, num_channels=3)


ARCHITECTURES: dict[str, Arch] = {
    "gpt2": Arch("decoder LM, tied embedding", lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1,
        embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)), _tokens),
    "llama": Arch("decoder LM, tied embedding, RMSNorm, rotary", lambda: tf.LlamaForCausalLM(
        tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=32, tie_word_embeddings=True,
                       attention_dropout=0.1)), _tokens),
    "opt": Arch("decoder LM, tied embedding, learned positions", lambda: tf.OPTForCausalLM(
        tf.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                     num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=32,
                     dropout=0.1)), _tokens),
    "bert": Arch("encoder LM, tied decoder", lambda: tf.BertForMaskedLM(tf.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, **HIDDEN)), _tokens),
    "t5": Arch("encoder-decoder, tied, relative position bias", lambda: (
        tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.1,
            tie_word_embeddings=True))), _seq2seq),
    "bart": Arch("encoder-decoder, shared embeddings", lambda: (
        tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.1, pad_token_id=1,
            bos_token_id=0, eos_token_id=2, decoder_start_token_id=2))), _seq2seq),
    "mixtral": Arch("mixture of experts (top-2 of 4)", lambda: tf.MixtralForCausalLM(
        tf.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=32, attention_dropout=0.1)), _tokens),
    "vit": Arch("vision transformer, class token and position embeddings", lambda: (
        tf.ViTForImageClassification(tf.ViTConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            patch_size=8, **HIDDEN, **_vision()))), _images(5)),
    "swin": Arch("windowed attention, relative position table", lambda: (
        tf.SwinForImageClassification(tf.SwinConfig(
            embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2, patch_size=4,
            hidden_dropout_prob=0.1, **_vision()))), _images(5)),
    "resnet": Arch("CNN with batch norm", lambda: tf.ResNetForImageClassification(
        tf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                        layer_type="basic", num_labels=5, num_channels=3)), _images(5)),
    "convnext": Arch("CNN with layer scale", lambda: tf.ConvNextForImageClassification(
        tf.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5,
                          num_channels=3, drop_path_rate=0.1)), _images(5)),
    "clip": Arch("two towers, bare root parameter read last (logit_scale)", lambda: (
        tf.CLIPModel(tf.CLIPConfig(
            text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=2,
                             max_position_embeddings=SEQ, dropout=0.1,
                             bos_token_id=0, eos_token_id=1, pad_token_id=1),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, image_size=IMAGE, patch_size=8,
                               dropout=0.1),
            projection_dim=16))), _clip_batch),
}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """The architecture with weights drawn from ``seed``, in training mode (dropout on)."""
    torch.manual_seed(seed)
    model = ARCHITECTURES[name].make()
    model.train()
    return model


def batches(name: str, steps: int, rank: int) -> list[dict]:
    gen = torch.Generator().manual_seed(500 + rank)
    return [ARCHITECTURES[name].batch(gen) for _ in range(steps)]
