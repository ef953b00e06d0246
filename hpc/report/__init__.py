"""``hpc report``: where a job's allocated node-time went (the goodput ledger) and a picture.

- :mod:`hpc.contract.ledger`: events in, ledger out (pure; unit-tested on recorded streams);
- :mod:`hpc.contract.young_daly`: the checkpoint interval rule (pure);
- :mod:`hpc.contract.spare_waits`: which node waited as a hot spare, and when it joined (pure);
- :mod:`hpc.report.load`: reads a job directory (and Slurm's accounting, when there is a job id);
- :mod:`hpc.report.table`: the terminal table and the JSON;
- :mod:`hpc.report.plot`: the timeline PNG (matplotlib, imported only there);
- :mod:`hpc.report.command`: the ``hpc report`` command.

Nothing here imports torch, and matplotlib only when a picture is asked for.
"""
