"""Recovery without restart on the training processes' side: survivors keep their processes, the state comes from a peer.

* :mod:`runtime.inprocess.worker.guard`: a failed step becomes a flag and leaves no trace (bounded
  all-reduces that never raise, a guarded optimizer step, the small state kept per step);
* :mod:`runtime.inprocess.worker.membership`: the new generation agreed in the store (the keys and
  pure rules: :mod:`runtime.inprocess.protocol`);
* :mod:`runtime.inprocess.worker.transfer`: one state transfer, by broadcast from the member that
  holds the agreed step (also the join path of a restarted worker or a hot spare);
* :mod:`runtime.inprocess.worker.stages`: the stages in order (abort, re-form, group, transfer,
  re-wrap), driven by the Session.
"""
