"""erdma_core.torch.counters(): the erdma group's counters through torch; a group of another backend refused."""

import torch
import torch.distributed as dist

import erdma_core.torch

try:
    erdma_core.torch.counters()
except ValueError as exc:
    assert "no default process group" in str(exc), exc
else:
    raise AssertionError("counters() before init_process_group")
dist.init_process_group("erdma")
t = torch.ones(8)
dist.all_reduce(t)
default = erdma_core.torch.counters()
assert default == dist.group.WORLD._get_backend(torch.device("cpu")).pg.counters(), default
assert isinstance(default, dict)
gloo = dist.new_group(backend="gloo")
try:
    erdma_core.torch.counters(gloo)
except ValueError as exc:
    assert "the group's backend is 'gloo', not 'erdma'" in str(exc), exc
else:
    raise AssertionError("counters() of a gloo group")
sub = dist.new_group([0, 1])
assert isinstance(erdma_core.torch.counters(sub), dict)
dist.destroy_process_group()
print("OK", flush=True)
