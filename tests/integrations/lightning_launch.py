"""A user's script: ``python lightning_launch.py OUT_DIR``. Lightning launches the second rank and the
process group itself; each rank saves its params after DistributedFusedAdamStrategy and after
strategy="ddp" + AdamW (clipping every step, accumulating 2 batches) to OUT_DIR/rank{r}.pt."""

from __future__ import annotations

import sys

import lightning as L
import torch
from torch import nn

from distopt import DistributedFusedAdam
from distopt.integrations.lightning import DistributedFusedAdamStrategy


class Net(L.LightningModule):
    def __init__(self, dfa: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.dfa = dfa

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = DistributedFusedAdam if self.dfa else torch.optim.AdamW
        return opt(self.parameters(), lr=1e-2, weight_decay=0.05)


def train(strategy, dfa: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g))
    model = Net(dfa)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, gradient_clip_val=0.05,
                        accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=2))
    return [p.detach().clone() for p in model.parameters()], trainer.global_rank


if __name__ == "__main__":
    torch.set_num_threads(1)
    run, rank = train(DistributedFusedAdamStrategy(), dfa=True)
    ref, _ = train("ddp", dfa=False)
    torch.save({"run": run, "ref": ref}, f"{sys.argv[1]}/rank{rank}.pt")
