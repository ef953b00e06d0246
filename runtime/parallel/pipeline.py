"""Pipeline parallel: each rank of the ``pp`` dimension runs one stage of the model.

The user cuts the model (``split(model, stage, num_stages)`` keeps this stage's layers and drops
the others, keeping the parameter names: a layer ``blocks.3`` is ``blocks.3`` in whichever stage
holds it, so a checkpoint's keys are the whole model's and a stage loads its own whatever
the number of stages was at the save). The stage is then split by the TP plan and sharded
with FSDP2 over the data-parallel ranks like a whole model, and ``torch.distributed.pipelining``
runs a schedule over it: GPipe (every micro-batch forward, then every backward) or 1F1B (one
forward, one backward in turn once the pipeline is full: at most ``pp`` micro-batches of
activations live per stage). The micro-batches split this data-parallel rank's share of the
global batch, so they replace gradient accumulation; torch scales the gradients by their
number, as the accumulated loss does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from runtime.parallel.mesh import MeshPlace

SCHEDULES = ("gpipe", "1f1b")


class Pipeline:
    """This rank's stage and the schedule that runs a step through every stage.

    Args:
        module: This stage's part of the model (already split, parallelized and sharded).
        place: Where this rank sits in the mesh (its ``pp`` coordinate is its stage).
        loss_fn: ``loss_fn(output, target)`` on the last stage, per micro-batch.
        microbatches: Micro-batches per step (1F1B needs at least ``pp``).
        schedule: ``"gpipe"`` or ``"1f1b"``.
        device: The stage's device.

    Raises:
        ValueError: For an unknown schedule or too few micro-batches.
    """

    def __init__(self, module: torch.nn.Module, place: MeshPlace, *, loss_fn: Callable[..., torch.Tensor],
                 microbatches: int, schedule: str, device: torch.device) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stages = place.mesh.pp
        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
        if microbatches < 1 or (schedule == "1f1b" and microbatches < stages):
            raise ValueError(f"{microbatches} micro-batches for a {schedule} pipeline of {stages} "
                             f"stages: give at least {stages if schedule == '1f1b' else 1}")
        self.module = module
        self.index = place.coords["pp"]
        self.stages = stages
        self._group = place["pp"].get_group()
        self.stage = PipelineStage(module, self.index, stages, device, group=self._group)
        runner = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        self.schedule = runner(self.stage, microbatches, loss_fn=loss_fn)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Runs forward and backward of every micro-batch through the pipeline (all stages
        call it with the same batch; only the first uses ``inputs``, only the last ``targets``).

        Returns:
            The step's loss (the micro-batches' mean), on every stage.
        """
        losses: list[torch.Tensor] = []
        target = targets if self.is_last else None
        if self.is_first:
            self.schedule.step(inputs, target=target, losses=losses)
        else:
            self.schedule.step(target=target, losses=losses)
        loss = torch.stack([x.detach().float() for x in losses]).mean() if losses \
            else torch.zeros((), device=inputs.device)
        dist.all_reduce(loss, group=self._group)     # the last stage's value, everywhere
        return loss

    def parameters(self) -> Any:
        return self.module.parameters()
