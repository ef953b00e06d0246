"""The control plane at N nodes, simulated on one machine (issue 29).

The project's real coordination code (torch's c10d rendezvous and its libuv ``TCPStore``,
the launchers' :class:`~runtime.liveness.beacon.PeerBeacon`, the stall watch's node records on
the job directory, :mod:`runtime.succession`'s election, the event records and
``hpc status``/``hpc report``) run for N simulated nodes: a few OS processes
(:mod:`.nodes`) each host many node agents as threads; fake workers publish only what real
ones publish. :mod:`.run` drives one N and writes ``benchmarks/scale.json``; :mod:`.history`
builds and reads a synthetic job history; :mod:`.meter` counts store requests and job-dir
file-system operations; :mod:`.fit` fits growth exponents. See ``docs/scale.md``.
"""
