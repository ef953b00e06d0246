"""A test worker that fills the job directory's disk with its own log output (a chatty
script on a small quota), until the write fails with ENOSPC."""
import torch.distributed as dist

dist.init_process_group("gloo")
line = "x" * 1000
while True:
    print(line, flush=True)
