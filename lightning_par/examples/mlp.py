"""The lecture's small MLP: a stack of dim x dim linear layers, with a synthetic regression task."""

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class MLPLayer(nn.Module):
    """Linear(dim, dim) followed by GELU (or nothing, for the output layer)."""

    def __init__(self, dim: int, activation: bool = True):
        super().__init__()
        self.fc = nn.Linear(dim, dim, bias=False)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        return F.gelu(x) if self.activation else x


class MLP(nn.Module):
    """`n_layers` MLPLayers; the last one has no activation so the output can reach any regression target.

    Tensor parallelism pairs the layers Megatron-style: colwise then rowwise, so each pair needs a single
    all-reduce. With an odd `n_layers` the last layer has no partner and stays replicated.
    """

    pp_plan = {"layers": (["x"], ["x"])}

    def __init__(self, dim: int = 1024, n_layers: int = 4):
        super().__init__()
        if dim <= 0 or n_layers <= 0:
            raise ValueError(f"dim and n_layers must be positive, got dim={dim}, n_layers={n_layers}")
        self.dim = dim
        self.layers = nn.ModuleDict({str(i): MLPLayer(dim, activation=i < n_layers - 1) for i in range(n_layers)})
        # Per-instance because the alternation depends on n_layers.
        n_paired = n_layers - n_layers % 2
        self.tp_plan = {f"layers.{i}.fc": "colwise" if i % 2 == 0 else "rowwise" for i in range(n_paired)}

    def pipeline_units(self) -> list[str]:
        """Each remaining layer is one pipeline unit: ["layers.0", "layers.1", ...]."""
        return [f"layers.{key}" for key in self.layers.keys()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


class MLPLightningModule(L.LightningModule):
    """Regression with the MLP and an MSE loss (pair with `MLPDataModule` of the same `dim`).

    Args:
        dim: Width of every layer.
        n_layers: Number of linear layers.
        lr: AdamW learning rate.
    """

    def __init__(self, dim: int = 64, n_layers: int = 4, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.model: MLP | None = None

    def configure_model(self):
        if self.model is None:
            self.model = MLP(self.hparams.dim, self.hparams.n_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True, on_step=True, batch_size=x.size(0))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, on_epoch=True, batch_size=x.size(0))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class MLPDataModule(L.LightningDataModule):
    """Synthetic regression y = x @ W for a fixed random W; 10% of the samples are held out for validation.

    Args:
        dim: Input and output width.
        n_samples: Total number of (x, y) pairs.
        batch_size: Samples per batch.
        seed: Seed of the data's own generator (the global RNG is left untouched).
    """

    def __init__(self, dim: int = 64, n_samples: int = 4096, batch_size: int = 32, seed: int = 0):
        super().__init__()
        self.save_hyperparameters()
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None):
        if self.train_set is not None:
            return
        hp = self.hparams
        gen = torch.Generator().manual_seed(hp.seed)
        weight = torch.randn(hp.dim, hp.dim, generator=gen) / hp.dim**0.5  # keeps y at unit variance
        x = torch.randn(hp.n_samples, hp.dim, generator=gen)
        y = x @ weight
        n_val = max(1, hp.n_samples // 10)
        self.train_set = TensorDataset(x[n_val:], y[n_val:])
        self.val_set = TensorDataset(x[:n_val], y[:n_val])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)
