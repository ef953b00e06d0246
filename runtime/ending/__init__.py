"""The end of an allocation: what node 0's launcher does once its elastic agent has returned.

It runs in the per-node launcher (:mod:`runtime.launch`), after the agent: classify how the
allocation ended and record it (:mod:`.outcome`), keep bad nodes out of the next allocations
(:mod:`runtime.exclusions`), then either requeue the same Slurm job exactly once
(:mod:`.requeue`), continue as a new job when the requeue budget is spent (:mod:`.resubmit`), or
end. No training process imports these modules.
"""
