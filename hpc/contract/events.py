"""``JOB_DIR/events.jsonl``: the job-directory contract of the event stream (torch-free).

The runtime appends (:mod:`runtime.events`), ``hpc report`` reads (:mod:`hpc.report`). One
JSON object per line with at least ``t`` (wall time, seconds), ``ev`` (the name) and
``alloc`` (the allocation). The names, who writes them and their own fields:

=====================  =========  ==============================================================
``alloc_start``        launcher   each node: ``node_rank``, ``slurm_job_id``
``node_ready``         launcher   the node passed its health check and joins (``spare_nodes``: the
                                 job's hot spares; a node that waits while others train is one)
``rdzv_join``          launcher   the node's agent joins the rendezvous of ``epoch`` (the host names
                                 the nodes without one when its round times out)
``agent_rendezvous``   launcher   the elastic agent's rendezvous round ``[t0, t]``
``workers_started``    launcher   the agent started (or restarted) its workers
``workers_ended``      launcher   the agent's last workers ended (``state``: SUCCEEDED, FAILED...)
``signal``             launcher   a warning signal reached the node (``signal``)
``alloc_end``          launcher   ``kind`` and ``exit_code`` as in ``outcomes.jsonl``
``session_start``      rank 0     ``restart``, ``t_proc`` (when the worker process started)
``rendezvous``         rank 0     the process group is up (``world_size``)
``restore_begin/end``  rank 0     ``step`` resumed at (``from_checkpoint``)
``loop_start``         rank 0     the step loop begins at ``step``
``first_step``         rank 0     the first step of this run is done
``steps``              rank 0     steps ``first..last`` (``count``) ran in ``[t0, t]``
``ckpt_save``          rank 0     a save of ``step`` blocked training ``block_s``
``ckpt_commit``        rank 0     the save of ``step`` is committed; it took ``save_s`` in all
``ckpt_interval``      rank 0     ``--checkpoint-interval auto`` chose ``every_s`` (and why)
``stop_begin/end``     rank 0     the agreed stop (``kind``, ``signal``; ``saved_step``)
``crash``              rank 0     the training raised (``error``, ``step``)
``session_end``        rank 0     the worker tears down (``ok``)
``inproc_detect``      launcher   ``--recovery inprocess``: a worker died (``pid``, ``rank``,
                                  ``exit``), announced in the store for generation ``gen``; or,
                                  from a peer, ``workers`` announced dead: ``by: lifeline``
                                  (connection closed; ``launcher_gone``) or ``lost_node`` (beacon)
``inproc_fallback``    launcher   every local worker is gone: torch's restart path (``reason``);
                                  ``spare: true``: a hot spare's launcher left its joiners (the
                                  members gave up, or the store's host is lost); from rank 0: a
                                  model in-process recovery cannot carry yet (a mesh, FSDP2 on
                                  NCCL) or a sharded recovery's fallback to the checkpoint
``spare_ready``        launcher   an in-process hot spare's ``joiners`` all wait in the store,
                                  ``waited_s`` after they started
``inproc_recovery``    new rank 0 an in-process recovery: ``gen``, ``world_size`` (was
                                  ``old_world_size``), ``step`` gone on from, ``held``, ``left``,
                                  and the stage ends ``t_detect/t_abort/t_reform/t_group/
                                  t_transfer``, ``bytes`` moved, the training ``backend``
                                  (``nccl``: ``nccl_aborted``, NCCL backends aborted);
                                  ``retries``: recoveries a second fault ended (``gen``,
                                  ``stage``, ``reason``, ``held``, ``holds``: the step held after)
=====================  =========  ==============================================================

Rank-0 events also carry ``rank`` and ``restart``; every event carries ``node``.
"""

from __future__ import annotations

from operator import itemgetter
from pathlib import Path
from typing import Any

from hpc.contract import jobpaths, records

EVENTS = jobpaths.EVENTS


def read_events(job_dir: str | Path) -> list[dict[str, Any]]:
    """All events of a job, in time order; a torn or foreign line is skipped (and reported)."""
    out = records.read(jobpaths.JobPaths(Path(job_dir)).events, records.event)
    out.sort(key=itemgetter("t"))
    return out
