"""How often rank 0 writes ``progress.json``: ``HPC_PROGRESS_EVERY_S=0`` means every step.

The benchmarks and the cluster tests set 0 to time resumes by the step; the Session read it as
falsy and wrote every 2 s (the default), so a resume was seen up to 2 s late and a campaign's
faults up to ~14 steps late.
"""

from __future__ import annotations

import pytest

from hpc.contract.environment import JobEnvironment
from runtime.session import PROGRESS_EVERY_S, progress_interval

pytestmark = pytest.mark.unit


def test_zero_means_every_step_and_unset_the_default():
    assert progress_interval(JobEnvironment.from_env({"HPC_PROGRESS_EVERY_S": "0"}).progress_every_s) == 0.0
    assert progress_interval(JobEnvironment.from_env({"HPC_PROGRESS_EVERY_S": "0.5"}).progress_every_s) == 0.5
    assert progress_interval(JobEnvironment.from_env({}).progress_every_s) == PROGRESS_EVERY_S == 2.0
