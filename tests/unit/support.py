"""Helpers that unit test modules share (and the slurm tier's test_api): sbatch's own #SBATCH
argument parser, a batch script run in bash with stand-in Slurm commands, and a prelude for
``python -c`` that makes torch, wandb, torchx, submitit and matplotlib unimportable (what a login
node must not load)."""

from __future__ import annotations

import stat
import subprocess
import textwrap
from pathlib import Path


def sbatch_parse_argument(line: str) -> list[str]:
    """Slurm 22.05's _get_argument loop (src/sbatch/opt.c), applied to a whole #SBATCH line."""
    args, i = [], 0
    while True:
        while i < len(line) and line[i].isspace():
            i += 1
        if i >= len(line):
            return args
        arg, quoted, q, esc = [], False, "", False
        while i < len(line) and (quoted or not line[i].isspace()):
            c = line[i]
            if esc:
                esc = False
            elif c == "\\":
                esc, i = True, i + 1
                continue
            elif quoted:
                if c == q:
                    quoted, i = False, i + 1
                    continue
            elif c in "\"'":
                quoted, q, i = True, c, i + 1
                continue
            elif c == "#":
                return args + ["".join(arg)] if arg else args
            arg.append(c)
            i += 1
        args.append("".join(arg))


def _stub_bin(tmp_path: Path, scripts: dict[str, str]) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        p = bin_dir / name
        p.write_text("#!/bin/bash\n" + body)
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return bin_dir


# srun stand-in: records its argv (one per line), drops its own options, runs the command.
SRUN = """printf '%s\\n' "$@" > "$RECORD/srun.argv"
while [ "${1#--}" != "$1" ]; do shift; done
"$@"
"""


def _run_script(text: str, tmp_path: Path, extra: dict[str, str] | None = None,
                stubs: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    record = tmp_path / "record"
    record.mkdir(exist_ok=True)
    bin_dir = _stub_bin(tmp_path, {"srun": SRUN, "scontrol": 'echo "$@" >> "$RECORD/scontrol"\n'
                                   '[ "$1" = show ] && [ "$2" = hostnames ] && echo node1\n'
                                   '[ "$1" = show ] && [ "$2" = partition ] && '
                                   'echo "PartitionName=low GraceTime=10 State=UP"\ntrue\n',
                                   "squeue": 'echo 2030-01-01T00:00:00\n', **(stubs or {})})
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RECORD": str(record), "HOME": str(tmp_path),
           "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_JOB_PARTITION": "low", **(extra or {})}
    return subprocess.run(["bash", "-c", text], env=env, capture_output=True, text=True,
                          timeout=30, cwd=tmp_path)


BLOCK_HEAVY = textwrap.dedent("""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "wandb", "torchx", "submitit", "matplotlib"):
                raise ImportError("login node must not import " + name)
    sys.meta_path.insert(0, Block())
""")
