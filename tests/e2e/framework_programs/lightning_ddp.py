"""A Lightning BoringModel trained with strategy="ddp" on CPU, 2 processes (Lightning launches
the second one itself).

``bad``: in ``setup`` the user adds a barrier on the global-zero rank only; it pairs with
Lightning's own barrier after ``setup`` on the other rank, and the mismatch surfaces later between
two of Lightning's calls. ``good``: the barrier on every rank.
"""

import datetime
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

BUG = sys.argv[1:] == ["bad"]


class RandomDataset(Dataset):
    def __init__(self, size: int, length: int) -> None:
        self.data = torch.randn(length, size)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class BoringModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        return self(batch).sum()

    def setup(self, stage: str) -> None:
        # "rank 0 prepares the data, the others wait for it"
        if BUG:
            if self.trainer.is_global_zero:  # (guard)
                self.data_ready = True
                self.trainer.strategy.barrier()  # BUG: a barrier on one rank only
        else:
            if self.trainer.is_global_zero:
                self.data_ready = True
            self.trainer.strategy.barrier()

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


def main() -> None:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=DDPStrategy(timeout=datetime.timedelta(seconds=20)), accelerator="cpu",
                        devices=2, max_epochs=1, limit_train_batches=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(BoringModel(), DataLoader(RandomDataset(32, 64), batch_size=4))


if __name__ == "__main__":
    main()
