"""A Session loop whose ranks log different metrics (tests/distributed/test_metric_rows.py):
every rank logs ``loss`` each step; rank 0 logs ``val`` at step 4 only (an evaluation on rank
0), rank 1 logs ``r1`` (summed) each step and ``peak`` (max) from step 2 on; ``seen`` is logged
by every rank at step 6 only. A row is logged every step."""
import torch

from runtime.session import Session

with Session(seed=0, log_every=1) as s:
    model = s.wrap(torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = s.restore(model=model, optim=opt)
    for step in s.steps(start, 8):
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        s.log(loss=float(s.rank + step))
        if s.rank == 0 and step == 4:
            s.log(val=10.0)
        if s.rank == 1:
            s.log(ops={"r1": "sum"}, r1=float(step))
            if step >= 2:
                s.log(ops={"peak": "max"}, peak=float(100 + step))
        if step == 6:
            s.log(seen=float(s.rank))
    s.finish()
