"""A Session script with an FSDP2 model under ``HPC_RECOVERY=inprocess`` (tests): on one node
no peer copy of the shards can be kept, and the log must say so; the job must train. Prints
``INPROC=<on|off>`` after wrapping."""

import torch

from runtime.session import Session

with Session(seed=0) as s:
    model = s.wrap(torch.nn.Linear(4, 2), fsdp=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = s.restore(model=model, optim=opt)
    print("INPROC=" + ("on" if getattr(s._recovery, "inproc", None) is not None else "off"), flush=True)
    for step in s.steps(start, 3):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
print("TRAINED", flush=True)
