"""The launcher's config: every hpc.toml option (the JobSpec's own declarations) plus a few
of the launcher's own, registered as ``hydra/launcher=hpc`` and ``hydra/launcher=hpc_local``.

The option names are the keys of ``hpc.toml`` (``nodes``, ``nproc_per_node``, ``time``,
``partition``, ``gpus_per_node``, ``signal_lead``, ``wandb_project`` ...): the dataclass is
made from :data:`hpc.contract.jobspec.CONFIG_KEYS`, so a new JobSpec option is a launcher
option without touching this file, and a key Hydra does not know fails there, listing the
valid ones. Each value is parsed and checked like its flag when the launcher builds the spec
(:mod:`.launcher`); unset ones (None) take the user's hpc.toml, then JobSpec's defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from hpc.contract.jobspec import CONFIG_KEYS

LAUNCHER_FIELDS = ("throttle", "poll_interval_s", "timeout_s")
HPC = "hydra_plugins.hpc_launcher.launcher.HpcLauncher"
HPC_LOCAL = "hydra_plugins.hpc_launcher.launcher.HpcLocalLauncher"


def _make(name: str, target: str) -> type:
    """A structured config: ``_target_``, the launcher's fields, then every hpc.toml key."""
    own: list[tuple[str, Any, Any]] = [
        ("_target_", str, dataclasses.field(default=target)),
        # At most this many tasks run at once (sbatch --array's %N; 0: no limit).
        ("throttle", int, dataclasses.field(default=0)),
        # Longest pause between two looks at the array while waiting for it.
        ("poll_interval_s", float, dataclasses.field(default=30.0)),
        # Give up waiting after this many seconds (None: wait until every task ended).
        ("timeout_s", Optional[float], dataclasses.field(default=None)),
    ]
    defaults = {"job_dir": "${hydra.sweep.dir}/.hpc", "job_name": "${hydra.job.name}"}
    options = [(key, Optional[Any], dataclasses.field(default=defaults.get(key)))
               for key in CONFIG_KEYS]
    return dataclasses.make_dataclass(name, own + options)


HpcLauncherConf = _make("HpcLauncherConf", HPC)
HpcLocalLauncherConf = _make("HpcLocalLauncherConf", HPC_LOCAL)

ConfigStore.instance().store(group="hydra/launcher", name="hpc", node=HpcLauncherConf,
                             provider="hpc_launcher")
ConfigStore.instance().store(group="hydra/launcher", name="hpc_local", node=HpcLocalLauncherConf,
                             provider="hpc_launcher")
