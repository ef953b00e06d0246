"""In-process recovery on the per-node launcher's side (python -m runtime.launch).

* :mod:`~runtime.inprocess.launcher.agent`: torch's agent that announces a dead worker and
  starts its joiner instead of restarting the others;
* :mod:`~runtime.inprocess.launcher.adopt`: the workers kept through the rendezvous host's loss,
  handed to the next epoch's agent;
* :mod:`~runtime.inprocess.launcher.lifelines`: a crashed node's workers named by the
  connections that closed;
* :mod:`~runtime.inprocess.launcher.silent`: stopped workers and silent nodes;
* :mod:`~runtime.inprocess.launcher.spare`: a hot spare's launcher;
* :mod:`~runtime.inprocess.launcher.standby`: the node's warm standby, a dead worker's joiner.
"""
