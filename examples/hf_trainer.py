"""Fine-tune a small GPT-2 with the Hugging Face Trainer, gradients scheduled by dcredit_hvd.

One line away from the plain Trainer script: the import of ``DCreditTrainer`` and its name in
place of ``Trainer`` (the DDP version: ``from transformers import Trainer`` and
``trainer = Trainer(...)``).  Launched as the plain script is:

    torchrun --nproc-per-node 2 examples/hf_trainer.py
    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer.py    # on GPUs

Random token data and a model built from a config, so nothing is downloaded.
"""
from __future__ import annotations

import tempfile

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from dcredit_hvd.frameworks.hf import DCreditTrainer as Trainer  # was: from transformers import Trainer


class RandomTokens(Dataset):
    """Random sequences (the same on every rank); the labels are the inputs (causal LM)."""

    def __init__(self, samples: int = 512, seq: int = 64, vocab: int = 1024) -> None:
        self.samples, self.seq, self.vocab = samples, seq, vocab

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=64, n_embd=128, n_layer=4,
                                       n_head=4, bos_token_id=0,
                                       eos_token_id=0))
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="hf_trainer_"), max_steps=30,
                             per_device_train_batch_size=8, learning_rate=3e-4, warmup_steps=5,
                             logging_steps=10, save_steps=15, eval_strategy="steps",
                             eval_steps=15, report_to=[], use_cpu=not torch.cuda.is_available())
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(),
                      eval_dataset=RandomTokens(64))
    trainer.train()


if __name__ == "__main__":
    main()
