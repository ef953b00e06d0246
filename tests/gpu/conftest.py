"""The gpu tier: tests that need a CUDA device, run on a GPU machine whenever one is available.

Every test here is marked ``gpu`` and skipped, all at once and only here, when this machine has
no CUDA device; the reason says exactly that. Nothing else may skip them, except a test that
needs more devices than the node has (:func:`need_cuda_devices`: "needs 2 CUDA devices; found
1"): on a GPU node any other test that cannot run fails with its reason.
"""

from __future__ import annotations

import pytest

NO_CUDA = "no CUDA device is present (torch.cuda.is_available() is False): the gpu tier needs one"


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = [item for item in items if item.path.is_relative_to(config.rootpath / "tests" / "gpu")]
    if here and not cuda_available():
        for item in here:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


def need_cuda_devices(n: int) -> None:
    """Skips the calling test, naming what is missing, where fewer than ``n`` CUDA devices exist."""
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < n:
        pytest.skip(f"needs {n} CUDA device{'s' if n > 1 else ''}; found {found}")
