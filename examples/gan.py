"""A GAN that learns to draw the 8x8 handwritten digits: two optimizers, manual optimization.

The generator turns random vectors into images; the discriminator tells them from the real
digits in ``examples/data/``. Each training step updates the discriminator, then the generator,
with their own optimizers (``self.automatic_optimization = False``, as in Lightning). When training
ends it prints a few generated digits as text. Run from the repository root::

    cadence fit --config examples/gan.yaml
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torch.utils.data import DataLoader, TensorDataset

from examples.digits import load_digits
from trainer import DataModule, TrainingModule

#: Characters from light to dark, for printing 8x8 images as text.
SHADES = " .:-=+*#%@"


class DigitsGAN(TrainingModule):
    """A generator and a discriminator, both small MLPs, trained against each other.

    Args:
        latent: size of the random vector the generator starts from.
        hidden: width of the hidden layers.
        lr: Adam learning rate of both networks.
        num_samples: generated images printed when training ends.
    """

    def __init__(self, latent: int = 32, hidden: int = 256, lr: float = 5e-4, num_samples: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False  # two optimizers: training_step steps them itself
        self.generator = nn.Sequential(
            nn.Linear(latent, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden), nn.LeakyReLU(0.2),
            nn.Linear(hidden, 64), nn.Sigmoid(),
        )
        self.discriminator = nn.Sequential(
            nn.Linear(64, hidden), nn.LeakyReLU(0.2), nn.Dropout(0.3), nn.Linear(hidden, hidden), nn.LeakyReLU(0.2),
            nn.Dropout(0.3), nn.Linear(hidden, 1),
        )

    def forward(self, noise: torch.Tensor) -> torch.Tensor:
        """Images (N, 64) in [0, 1] from noise (N, latent)."""
        return self.generator(noise)

    def training_step(self, batch, batch_idx):
        real, _ = batch
        optimizer_g, optimizer_d = self.optimizers()
        fake = self(torch.randn(len(real), self.hparams.latent, device=real.device))

        # The discriminator: real images are 1, generated ones 0 (the generator is not updated).
        real_logits, fake_logits = self.discriminator(real), self.discriminator(fake.detach())
        loss_d = (F.binary_cross_entropy_with_logits(real_logits, torch.full_like(real_logits, 0.9))  # label smoothing
                  + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))) / 2
        optimizer_d.zero_grad()
        self.manual_backward(loss_d)
        optimizer_d.step()

        # The generator: make the discriminator call its images real.
        fooled_logits = self.discriminator(fake)
        loss_g = F.binary_cross_entropy_with_logits(fooled_logits, torch.ones_like(fooled_logits))
        optimizer_g.zero_grad()
        self.manual_backward(loss_g)
        optimizer_g.step()

        self.log_dict({"train/loss_d": loss_d, "train/loss_g": loss_g}, prog_bar=True)
        self.log("train/d_real", torch.sigmoid(real_logits).mean())  # how sure D is that real images are real

    def configure_optimizers(self):
        betas = (0.5, 0.999)  # the usual GAN choice: less momentum than Adam's default
        return [torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr, betas=betas),
                torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr, betas=betas)]

    def on_fit_end(self) -> None:
        if self.trainer.is_global_zero:
            print(f"\n{self.hparams.num_samples} generated digits after {self.trainer.global_step} optimizer steps:")
            print(draw(self.generate(self.hparams.num_samples)))

    @torch.no_grad()
    def generate(self, count: int, seed: int = 0) -> torch.Tensor:
        """``count`` images (count, 8, 8) in [0, 1], from a fixed seed."""
        noise = torch.randn(count, self.hparams.latent, generator=torch.Generator().manual_seed(seed))
        was_training = self.training
        self.eval()
        images = self(noise.to(self.device)).view(count, 8, 8).cpu()
        self.train(was_training)
        return images


class DigitsImages(DataModule):
    """Every digit image, for training only: a GAN has nothing to validate or test (a DataModule that
    defined ``val_dataloader`` would be warned about, as in Lightning, since the GAN has no validation_step).

    Args:
        batch_size: images per training batch.
    """

    def __init__(self, batch_size: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.images = TensorDataset(*load_digits())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.images, batch_size=self.batch_size, shuffle=True)


def draw(images: torch.Tensor, per_line: int = 4) -> str:
    """Images (N, 8, 8) in [0, 1] as text, ``per_line`` side by side (two characters per pixel)."""
    shade = (images.clamp(0, 1) * (len(SHADES) - 1)).round().long().tolist()
    lines = []
    for start in range(0, len(shade), per_line):
        group = shade[start:start + per_line]
        lines += ["   ".join("".join(SHADES[value] * 2 for value in image[row]) for image in group)
                  for row in range(len(group[0]))]
        lines.append("")
    return "\n".join(lines).rstrip()
