"""Run by tests/test_torch_clients.py on every rank (launched by torchrun or erdma run): a small Lightning
Trainer on the backend named in argv[1], logging with ``sync_dist=True`` a float loss (mean) and an int64
count, which Lightning reduces with ReduceOp.AVG on every backend not named "gloo". Rank 0 prints the
logged metrics as JSON."""

import json
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

import erdma_core.torch  # noqa: F401  (registers the backend)

BACKEND = sys.argv[1]


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 1)

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)
        big = (self.net(x) > 0).sum() + 10 * self.global_rank  # an int64 that differs across ranks
        self.log("val_positive", big, sync_dist=True, reduce_fx="mean")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader(seed: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)


trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend=BACKEND),
                    max_steps=6, limit_val_batches=2, num_sanity_val_steps=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
model = Regression()
trainer.fit(model, loader(1), loader(2))
if trainer.global_rank == 0:
    print(json.dumps({k: v.item() for k, v in sorted(trainer.callback_metrics.items())}), flush=True)
# end the group before exit, as a training script should: left to interpreter shutdown, torch's teardown
# aborted rank 0 once in CI ("terminate called without an active exception", exit -6)
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
