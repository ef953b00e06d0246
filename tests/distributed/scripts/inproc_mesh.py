"""A Session script on a device mesh (HSDP: 2 replicas of 1 shard) under
``HPC_RECOVERY=inprocess`` (tests): in-process recovery does not carry a mesh yet, so the
Session falls back to the restart path, says why in the log and in events.jsonl, and trains.
Prints ``INPROC=<on|off>`` after wrapping."""

import torch

from hpc.contract.parallel import ParallelDims
from runtime.session import Session

with Session(seed=0, parallel=ParallelDims(dp_replicate=2, dp_shard=1)) as s:
    model = s.wrap(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = s.restore(model=model, optim=opt)
    print("INPROC=" + ("on" if getattr(s._recovery, "inproc", None) is not None else "off"), flush=True)
    for step in s.steps(start, 3):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
print("TRAINED", flush=True)
