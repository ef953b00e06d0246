"""Recovery without restart (``--recovery inprocess``): the whole feature, in one wing.

A lost worker or node does not restart the others: the survivors keep their processes, agree
in the job's store on a new generation, form a new process group and take the training state
from a peer's memory (docs/inprocess.md). The wing's sub-folders say which process runs a file:

* :mod:`runtime.inprocess.protocol` (both sides): every store key with its writer and reader,
  and the records they hold;
* :mod:`runtime.inprocess.rules` (both sides, pure): who is dead to a re-form, when a
  generation closes, whom it takes in, where the state comes from, when the recovery gives up;
* :mod:`runtime.inprocess.launcher` (the per-node launcher): the agent around torch's, the
  adoption of workers kept through a rendezvous host's loss, the lifelines, the silent-loss
  watch, the hot spare and the warm standby;
* :mod:`runtime.inprocess.worker` (every training process): the recovery's stages, driven by
  the Session, and the warm standby process.

The settings a job gives it (``--recovery``, ``--replacement``, ``HPC_INPROC_*``) are the
contract's (:mod:`hpc.contract.recovery_settings`): the login side checks them at submission.
"""
