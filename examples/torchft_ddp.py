"""A torchft DDP job on eRDMA: one replica group per process (run two or more with different --replica-id
against one torchft Lighthouse). Kill one mid-run and start it again: the others go on without it, then it
rejoins, takes the live state from a peer and trains on; every replica ends with the same parameters.

    python -c "from torchft.coordination import LighthouseServer as L; import time; \
        l = L(bind='[::]:29510', min_replicas=1); print(l.address()); time.sleep(1e9)" &
    python examples/torchft_ddp.py --replica-id 0 --lighthouse http://localhost:29510 &
    python examples/torchft_ddp.py --replica-id 1 --lighthouse http://localhost:29510

Each replica prints "step N loss L participants P" per committed step and, at the end, "done step N params
SHA256". The data differ per replica and per step; the model is the same everywhere.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torchft import Manager
from torchft.ddp import DistributedDataParallel

from erdma_core.torchft import ProcessGroupErdma


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replica-id", type=int, required=True)
    ap.add_argument("--lighthouse", required=True, help="the Lighthouse's address (http://host:port)")
    ap.add_argument("--steps", type=int, default=30, help="train until the job's step count reaches this")
    ap.add_argument("--step-seconds", type=float, default=0.1, help="pause per step (as if it computed longer)")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds for quorum, set-up and collectives")
    args = ap.parse_args()

    torch.manual_seed(0)  # the same initial model everywhere (a restarted replica takes the live one anyway)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # this replica group's
    timeout = timedelta(seconds=args.timeout)
    manager = Manager(pg=ProcessGroupErdma(timeout=timeout), min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=f"replica_{args.replica_id}", store_addr="localhost",
                      store_port=store.port, rank=0, world_size=1, lighthouse_addr=args.lighthouse,
                      timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)
    ddp = DistributedDataParallel(manager, model)
    criterion = nn.CrossEntropyLoss()
    while manager.current_step() < args.steps:
        gen = torch.Generator().manual_seed(1000 * args.replica_id + manager.current_step())
        inputs, labels = torch.randn(32, 16, generator=gen), torch.randint(4, (32,), generator=gen)
        manager.start_quorum()  # this step's replicas (the group is reconfigured when they changed)
        optimizer.zero_grad()
        loss = criterion(ddp(inputs), labels)
        loss.backward()  # gradients averaged over the quorum's replicas, on eRDMA
        if manager.should_commit():  # every participant's allreduce succeeded: apply the step
            optimizer.step()
            print(f"step {manager.current_step()} loss {loss.item():.5f} participants "
                  f"{manager.num_participants()}", flush=True)
        time.sleep(args.step_seconds)
    params = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(f"done step {manager.current_step()} params {params}", flush=True)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
