"""A small character-level transformer language model, trained on Python's own source code.

The text is the standard library's ``.py`` files, read from ``sysconfig.get_paths()["stdlib"]``
(so it ships with every Python; tests and site-packages left out), capped at ``max_chars``. The
model is a GPT: token and position embeddings, pre-norm transformer blocks with causal
self-attention, tied output weights. It logs the validation loss and perplexity, and prints a few
sampled lines when training ends. Run from the repository root::

    cadence fit --config examples/charlm.yaml

and with the speed features (mixed precision, torch.compile, activation checkpointing) on a GPU::

    cadence fit --config examples/charlm.yaml --config examples/charlm_speed.yaml --trainer.strategy=cuda
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainer import TrainingModule

#: The characters the model knows: printable ASCII, tab and newline; anything else reads as "?".
VOCABULARY = "\t\n" + "".join(chr(code) for code in range(32, 127))
UNKNOWN = VOCABULARY.index("?")
_SKIPPED_DIRECTORIES = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idlelib", "lib2to3"}


def encode(text: str) -> torch.Tensor:
    """``text`` as a uint8 tensor of indices into VOCABULARY."""
    table = torch.full((256,), UNKNOWN, dtype=torch.uint8)
    table[torch.tensor([ord(c) for c in VOCABULARY])] = torch.arange(len(VOCABULARY), dtype=torch.uint8)
    raw = torch.frombuffer(bytearray(text.encode("ascii", errors="replace")), dtype=torch.uint8)
    return table[raw.long()]


def decode(indices: torch.Tensor) -> str:
    return "".join(VOCABULARY[index] for index in indices.tolist())


def stdlib_source(max_chars: int, root: str | None = None) -> str:
    """The first ``max_chars`` characters of the standard library's ``.py`` files, in sorted order."""
    root = root or sysconfig.get_paths()["stdlib"]
    parts, total = [], 0
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(name for name in subdirectories if name not in _SKIPPED_DIRECTORIES)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            text = Path(directory, name).read_text(encoding="utf-8", errors="replace")
            parts.append(text[:max_chars - total])
            total += len(parts[-1])
            if total >= max_chars:
                return "".join(parts)
    return "".join(parts)


class Windows(Dataset):
    """Non-overlapping windows of ``context + 1`` characters: (input, the input shifted by one)."""

    def __init__(self, tokens: torch.Tensor, context: int) -> None:
        self.tokens, self.context = tokens, context

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.context

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[index * self.context:(index + 1) * self.context + 1].long()
        return window[:-1], window[1:]


class StdlibText:
    """The standard library's source as training and validation windows (the last ``val_fraction``
    of the text validates). Not a DataModule subclass: a class with its loader methods is
    enough for ``cadence fit`` (``data:``), which calls them.

    Args:
        max_chars: how much source to read (about one byte per character).
        context: characters per training window (the model's context must be at least this).
        batch_size: windows per batch.
        val_fraction: share of the text held out for validation.
        num_workers: DataLoader worker processes.
    """

    def __init__(self, max_chars: int = 2_000_000, context: int = 64, batch_size: int = 32,
                 val_fraction: float = 0.05, num_workers: int = 0) -> None:
        tokens = encode(stdlib_source(max_chars))
        split = int(len(tokens) * (1 - val_fraction))
        self.train = Windows(tokens[:split], context)
        self.val = Windows(tokens[split:], context)
        self.batch_size, self.num_workers = batch_size, num_workers

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        # drop_last: every batch holds as many characters, so the mean of the batch losses is the
        # mean loss per character.
        return DataLoader(self.val, batch_size=self.batch_size, drop_last=True, num_workers=self.num_workers)


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each added to the residual."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.attention_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.projection = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.projection(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.mlp_norm(x))


def _small_init(module: nn.Module) -> None:
    # GPT-2's initialisation: with PyTorch's default N(0, 1) embeddings the tied output layer starts
    # with logits of standard deviation ~sqrt(width), and a first loss far above log(97).
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class CharLM(TrainingModule):
    """A GPT over characters.

    Args:
        context: the longest input, in characters.
        width: embedding width.
        depth: number of transformer blocks.
        heads: attention heads per block (``width`` must divide by it).
        dropout: dropout in attention and the MLPs.
        lr: peak AdamW learning rate, reached after ``warmup_steps``, then cosine-decayed to a tenth
            of it at ``Trainer(max_steps)``.
        weight_decay: AdamW weight decay (matrices only).
        warmup_steps: optimizer steps of linear warmup.
        sample_prompts: what the samples printed after training start with.
        sample_chars: characters sampled per prompt.
    """

    def __init__(self, context: int = 64, width: int = 96, depth: int = 2, heads: int = 4, dropout: float = 0.0,
                 lr: float = 3e-3, weight_decay: float = 0.1, warmup_steps: int = 20,
                 sample_prompts: list[str] | None = None, sample_chars: int = 240) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"CharLM(width={width}, heads={heads}): width must be a multiple of heads.")
        self.save_hyperparameters()
        self.token_embedding = nn.Embedding(len(VOCABULARY), width)
        self.position_embedding = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, len(VOCABULARY), bias=False)
        self.head.weight = self.token_embedding.weight  # tied: the same matrix reads and writes characters
        self.apply(_small_init)
        self._val_losses: list[torch.Tensor] = []  # this validation's batch losses, kept on the device

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = F.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val_losses = []

    def validation_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = F.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self._val_losses.append(loss.detach().float())

    def on_validation_epoch_end(self) -> None:
        # Perplexity is exp(mean loss per character), not the mean of per-batch perplexities. Every
        # batch holds as many characters, and under DDP every rank runs as many batches.
        mean_loss = self.trainer.strategy.all_reduce(torch.stack(self._val_losses).mean(), "mean")
        self.log("val/ppl", torch.exp(mean_loss), prog_bar=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": self.hparams.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=self.hparams.lr, betas=(0.9, 0.95))
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else 10_000
        warmup = min(self.hparams.warmup_steps, total - 1)
        schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [
            torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=max(warmup, 1)),
            torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total - warmup, 1), eta_min=self.hparams.lr / 10),
        ], milestones=[warmup])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_fit_end(self) -> None:
        if not self.trainer.is_global_zero:
            return
        metrics = self.trainer.callback_metrics
        if "val/ppl" in metrics:
            print(f"\nValidation perplexity {float(metrics['val/ppl']):.2f} (loss {float(metrics['val/loss']):.3f} "
                  f"nats per character) after {self.trainer.global_step} steps.")
        print("Samples (temperature 0.8):")
        for index, prompt in enumerate(self.hparams.sample_prompts or ["def ", "class ", "    if "]):
            print("---\n" + self.sample(prompt, self.hparams.sample_chars, seed=index))

    @torch.no_grad()
    def sample(self, prompt: str, num_chars: int, temperature: float = 0.8, seed: int = 0) -> str:
        """``prompt`` continued by ``num_chars`` characters drawn from the model."""
        was_training = self.training
        self.eval()
        generator = torch.Generator(device=self.device).manual_seed(seed)
        tokens = encode(prompt).long().to(self.device)[None]
        for _ in range(num_chars):
            logits = self(tokens[:, -self.hparams.context:])[0, -1] / temperature
            following = torch.multinomial(torch.softmax(logits.float(), dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, following[None]], dim=1)
        self.train(was_training)
        return decode(tokens[0])
