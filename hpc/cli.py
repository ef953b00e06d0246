"""The ``hpc`` command.

Flags for job options are generated from :class:`~hpc.contract.jobspec.JobSpec`'s field declarations,
so every option has one name, one parser and one help text everywhere. Bad input exits with
status 2 and one message naming the flag, the value, the valid form and an example, before
anything is created or submitted. This module imports nothing heavy: ``hpc --help`` must be
instant on a login node.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc import __version__, backends
from hpc.contract import spec_terms, values
from hpc.contract.errors import HpcError, SpecError, UsageError
from hpc.contract.jobspec import JobSpec, flag_name, option_fields, parse_options
from hpc.parser import HpcParser, options_before_command, subparser, unknown_arguments

EXIT_USAGE = 2

_SLURM_ONLY = {"partition", "account", "qos", "constraint", "exclude", "mem", "cpus_per_task",
               "gpus_per_node", "time_limit_s", "signal", "signal_lead_s", "requeue",
               "max_requeues", "python", "gpu_type", "exclusive", "reservation", "nodelist",
               "mail_type", "mail_user", "sbatch", "setup", "container_image", "container_mounts",
               "container_runtime", "after", "avoid_bad_nodes", "bad_node_faults",
               "bad_node_jobs"}


# Repeatable options whose command-line values are added to the profile's instead of replacing them.
ADDITIVE = frozenset({"sbatch", "setup", "container_mounts", "after"})


def _add_job_options(p: argparse.ArgumentParser, *, slurm: bool) -> None:
    p.add_argument("script", help="training script (a torchrun-style Python script)")
    p.add_argument("--config", default="", help="config file (default: ./hpc.toml, "
                   "[tool.hpc] in ./pyproject.toml, ~/.config/hpc/hpc.toml)")
    groups: dict[str, argparse._ArgumentGroup] = {
        "job": p.add_argument_group("job options (CLI > profile > defaults; see docs/config.md)")}
    for f in option_fields():
        if not slurm and f.name in _SLURM_ONLY:
            continue
        meta = f.metadata
        default = f.default
        help_text = meta["help"] + (f" [default: {_show(default)}]" if default not in ("", 0, ()) else "")
        kwargs: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS, help=help_text,
                                      metavar=meta.get("metavar") or f.name.upper().removesuffix("_S"))
        if meta.get("repeat"):
            kwargs["action"] = "append"
        if meta.get("flag"):   # --exclusive / --no-exclusive
            kwargs["action"] = argparse.BooleanOptionalAction
            del kwargs["metavar"]
        names = [flag_name(f.name)] + ([meta["short"]] if meta.get("short") else [])
        groups["job"].add_argument(*names, **kwargs)


def _show(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(x, int) for x in value):
        return str(value[0]) if value[0] == value[1] else f"{value[0]}:{value[1]}"
    return str(value)


def build_parser() -> argparse.ArgumentParser:
    parser = HpcParser(
        prog="hpc",
        description="Take a PyTorch training job from a Slurm login node to many nodes and keep "
                    "it alive there: preemption, time limits and node loss included.",
        epilog="Script arguments go after '--': hpc run train.py --nproc-per-node 2 -- --lr 3e-4")
    parser.add_argument("--version", action="version", version=f"hpc-elastic {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run locally (no Slurm): N processes through the elastic agent")
    _add_job_options(run, slurm=False)
    run.add_argument("-v", "--verbose", action="store_true",
                     help="show every log line on the console (the launcher's environment "
                          "decisions, torch's agent, the Session's set-up); the job directory's "
                          "logs always have them")

    for name, help_text in (("submit", "submit to Slurm"), ("render", "print the sbatch script that submit would run")):
        sp = sub.add_parser(name, help=help_text)
        _add_job_options(sp, slurm=True)
        sp.add_argument("--backend", default=backends.DEFAULT, choices=backends.names(),
                        help=f"how to submit [default: {backends.DEFAULT}]")
        if name == "submit":
            sp.add_argument("--dry-run", action="store_true", help="print what would run; submit nothing")

    sw = sub.add_parser("sweep", help="submit a grid of script arguments as one Slurm job array")
    _add_job_options(sw, slurm=True)
    sweep_opts = sw.add_argument_group("sweep options")
    sweep_opts.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                            help="a script argument and its values; the tasks are the product of "
                                 "all --grid (repeatable; the script gets --KEY V)")
    sweep_opts.add_argument("--grid-file", default="", metavar="TOML",
                            help="argument sets from a TOML file: a [grid] table or [[runs]] args")
    sweep_opts.add_argument("--throttle", default="0", metavar="N",
                            help="at most N tasks run at once (sbatch --array=...%%N) [default: no limit]")
    sweep_opts.add_argument("--dry-run", action="store_true", help="print what would run; submit nothing")

    st = sub.add_parser("status", help="state, nodes, elapsed, requeues and history of jobs")
    st.add_argument("job", nargs="*", help="job ids or job directories (default: your recent jobs)")
    st.add_argument("--json", action="store_true", help="machine-readable output")

    lg = sub.add_parser("logs", help="rank-0 output of a job, across requeues and restarts")
    lg.add_argument("job", help="job id or job directory")
    lg.add_argument("-f", "--follow", action="store_true", help="keep following until the job ends")
    lg.add_argument("--rank", type=int, default=0, help="which global rank [default: 0]")

    nd = sub.add_parser("nodes", help="each node's faults across your jobs, and which nodes the "
                                      "next submission avoids")
    nd.add_argument("--json", action="store_true", help="machine-readable output")
    defaults = {f.name: f for f in option_fields()}
    for name, metavar in (("bad_node_faults", "N"), ("bad_node_jobs", "M")):
        f = defaults[name]
        nd.add_argument(flag_name(name), default=str(f.default), metavar=metavar,
                        help=f"{f.metadata['help']} [default: {f.default}]")

    cn = sub.add_parser("cancel", help="cancel a job")
    cn.add_argument("job", nargs="+", help="job ids or job directories")

    from hpc.report.command import add_parser as add_report   # torch- and matplotlib-free
    add_report(sub)
    from hpc.sync import add_parser as add_sync   # wandb-free: the upload runs in wandb's process
    add_sync(sub)

    dr = sub.add_parser("doctor", help="check this node (or an allocation): network, GPUs, versions")
    dr.add_argument("--json", action="store_true", help="machine-readable output")
    dr.add_argument("--rdzv-host", default="", help="rendezvous host to check routes to")
    dr.add_argument("--nodes", default="", help="run across N nodes of a Slurm allocation via srun")
    return parser


def build_spec(args: argparse.Namespace) -> JobSpec:
    """Builds the validated JobSpec from CLI flags, the config profile and the defaults."""
    from hpc.contract import jobdir
    from hpc.config import find_config

    config = find_config(args.config)
    merged = config.parsed_options(getattr(args, "profile", ""))
    given = {f.name: getattr(args, f.name) for f in option_fields() if hasattr(args, f.name)}
    from_cli = parse_options(given, source=flag_name)
    # Site lists add up: the profile's --sbatch options, --setup lines and mounts come first,
    # the command line's after them (for --sbatch, a key given again takes the later value).
    for name in ADDITIVE & from_cli.keys() & merged.keys():
        from_cli[name] = tuple(dict((*merged[name], *from_cli[name])).items()) if name == "sbatch" \
            else (*merged[name], *from_cli[name])
    merged.update(from_cli)

    script = Path(args.script).expanduser()
    if not script.is_file():
        raise SpecError("SCRIPT", args.script, "an existing Python file",
                        "hpc run examples/train_gpt.py -- --preset tiny",
                        f"No such file (looked in {Path.cwd()})")
    merged.setdefault("job_name", script.stem)
    if not merged.get("job_dir"):
        merged["job_dir"] = str(jobdir.default_job_dir(merged["job_name"]))
    merged["job_dir"] = str(Path(merged["job_dir"]).expanduser().absolute())
    if merged.get("checkpoint_dir"):
        merged["checkpoint_dir"] = str(Path(merged["checkpoint_dir"]).expanduser().absolute())
    with spec_terms.cli_terms():   # errors name flags (--time), not fields (time_limit_s)
        return JobSpec(script=str(script.absolute()), script_args=tuple(args.script_args), **merged)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, script_args = argv[:i], argv[i + 1:]
    parser = build_parser()
    misplaced = options_before_command(parser, argv)
    if misplaced:
        parser.error(misplaced)
    args, extras = parser.parse_known_args(argv)
    if extras:   # the subcommand's usage, "did you mean", and where a script's arguments go
        command = subparser(parser, args.command)
        command.error(unknown_arguments(command, extras, argv, script_args))
    args.script_args = script_args
    args.argv = argv + (["--", *script_args] if script_args else [])   # to print how to resume
    try:
        with spec_terms.cli_terms():   # every error of the command names flags, not fields
            return _dispatch(args)
    except SpecError as e:
        print(f"hpc {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except UsageError as e:
        print(f"hpc {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except HpcError as e:
        print(f"hpc {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        from hpc.backends import local
        return local.run(build_spec(args), verbose=args.verbose, argv=args.argv)
    if args.command in ("submit", "render"):
        spec = build_spec(args)
        from hpc import submission as submit
        if args.command == "render" or args.dry_run:
            return submit.dry_run(spec, args.backend)
        return submit.submit(spec, args.backend)
    if args.command == "sweep":
        return _sweep(args)
    if args.command == "status":
        from hpc import status
        return status.main(args)
    if args.command == "logs":
        from hpc import logs
        return logs.main(args)
    if args.command == "nodes":
        from hpc import nodes
        return nodes.main(args)
    if args.command == "cancel":
        from hpc import status
        return status.cancel(args)
    if args.command == "doctor":
        return _doctor(args)
    if args.command == "sync":
        from hpc.sync import main as sync
        return sync(args)
    if args.command == "report":
        from hpc.report.command import main as report
        return report(args)
    raise AssertionError(args.command)


def _sweep(args: argparse.Namespace) -> int:
    """``hpc sweep``: the argument sets, then one job array (or its dry run)."""
    from hpc import api, sweeps
    from hpc.submission import _print_notes

    spec = build_spec(args)
    if bool(args.grid) == bool(args.grid_file):
        raise SpecError("--grid", " ".join(args.grid) or "(none)",
                        "either --grid KEY=V1,V2 (repeatable) or --grid-file FILE, not both",
                        "hpc sweep train.py --grid lr=1e-3,3e-4 --grid seed=1,2")
    arg_sets = sweeps.expand_grid(sweeps.parse_grid(args.grid)) if args.grid \
        else sweeps.load_file(Path(args.grid_file))
    throttle = values.parse_int(args.throttle, "--throttle", minimum=0, maximum=sweeps.MAX_TASKS,
                                example="--throttle 4")
    if args.dry_run:
        print(sweeps.plan(spec, arg_sets, throttle=throttle).describe(), end="")
        return 0
    sweep = api.sweep(spec, arg_sets, throttle=throttle, on_notes=_print_notes)
    print(f"Submitted sweep {sweep.job_id}: {len(sweep.jobs)} tasks of {spec.job_name} as one job array")
    print(f"Sweep directory: {sweep.record.job_dir} (task-<i>/ per task)")
    print(f"Watch it with: hpc status {sweep.job_id}")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    """``hpc doctor``: runs ``python -m runtime.launch.doctor`` here, or on every node of an
    allocation through srun (the checks need torch, which the login-node CLI never imports)."""
    import subprocess

    argv = [sys.executable, "-m", "runtime.launch.doctor"] + (["--json"] if args.json else []) \
        + (["--rdzv-host", args.rdzv_host] if args.rdzv_host else [])
    if args.nodes:
        from hpc.contract.slurm import SlurmClient

        nodes = values.parse_int(args.nodes, "--nodes", minimum=1)
        return SlurmClient().srun(argv + ["--multi-node"], nodes=nodes)
    return subprocess.call(argv)


if __name__ == "__main__":
    sys.exit(main())
