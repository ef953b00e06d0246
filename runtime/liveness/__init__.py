"""Liveness: notice a job that stops making progress while every process is still alive.

torch's elastic agent watches process exits only. A frozen worker, a rank stuck in its data
loading, a node whose link was cut (its processes live on, nothing closes a socket) leave every
rank blocked in a collective until the process group's timeout (600 s by default). This
package turns such silent stalls into an ordinary worker failure within seconds, with the
evidence kept:

- :mod:`.heartbeat`: each worker's Session writes a tiny per-rank record (step, phase, time,
  recent p99 step time) into a node-local directory, at most about once a second, without
  fsync and without any collective.
- :mod:`.deadline`: the pure stall deadline ``max(floor, k x recent p99 step time)``, with
  phases known to be long (start-up, restore, the first steps, a save, evaluation) given
  their own budgets; ``--stall-timeout auto|off|SECONDS``.
- :mod:`.verdict`: pure: from the records, the processes' states, the alive beats, the clock
  and the stacks, is this node stalled or a rank just running long, and who is the suspect.
- :mod:`.nodes`: each watchdog's record for the other nodes (latest progress, busy ranks):
  a rank elsewhere may be waiting for them.
- :mod:`.peers`: each launcher keeps a counter going in the rendezvous store and watches
  the others'; a node whose counter stops while we still reach the store is cut off.
- :mod:`.stacks`: the worker side registers ``faulthandler`` on :data:`.stacks.DUMP_SIGNAL`;
  the launcher side asks for and collects the dumps into one file in the job directory.
- :mod:`.watchdog`: the launcher's thread that ties these together: on a stall it dumps the
  stacks, records a ``hang`` event, and SIGKILLs the node's workers so the elastic agents
  re-form the group (without a node that cannot reach the rendezvous any more) and the
  workers resume from the last checkpoint.
- :mod:`.events`: the ``hangs.jsonl`` event log in the job directory (any node appends).
- :mod:`.stragglers`: ranks persistently slower than the others (work before their first
  collective), reported by rank 0, never killed.
- :mod:`.nccl`: NCCL's watchdog and flight-recorder settings for GPU jobs, coherent with the
  stall deadline.

Bad nodes (stalled, lost, failing their pre-join health check) are kept out of the next
allocations by :mod:`runtime.exclusions`; the check itself is :mod:`runtime.launch.health`.

Nothing here imports torch: the launcher's thread and ``hpc status`` use it too.
"""
