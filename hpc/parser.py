"""The ``hpc`` command's argument parser: no abbreviations, and errors that say what to do.

argparse alone answers a typo with the top-level usage line and nothing else, and by default
accepts any unambiguous prefix of a long option, so ``--nproc-per-nod 2`` silently means
``--nproc-per-node 2``. A typo must never run a job, so here:

- every parser has ``allow_abbrev=False``: an option is spelled out or it is unknown;
- an unknown option gets the subcommand's usage and ``did you mean --nproc-per-node?``
  (:mod:`difflib` over the subcommand's own options);
- an unknown argument that matches none of them is most likely the script's own (the ``--``
  was forgotten): the error says to put the script's arguments after ``--``, with the command
  rewritten that way;
- an unknown subcommand or choice (``hpc sumbit``) gets ``did you mean 'submit'?``.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shlex
from collections.abc import Sequence
from typing import Any, NoReturn

# How alike an unknown option must be to a known one to be suggested (difflib's ratio, on the
# names without their dashes): nprocs-per-node -> nproc-per-node is 0.97, nodez -> nodes 0.8,
# while a script's max-steps -> max-restarts (0.67) or log-every -> keep-every (0.63) is not.
SIMILAR = 0.75


def close_matches(word: str, candidates: Sequence[str], cutoff: float = SIMILAR) -> list[str]:
    """The candidates most like ``word`` (at most two), best first; leading dashes are ignored.

    Besides difflib's likeness, the same name with ``_`` for ``-`` or without them
    (``--job_dir``, ``--dryrun``), and two letters swapped (``--pgn`` for ``--png``) count,
    which difflib rates low for short names.
    """
    bare = {c.lstrip("-"): c for c in candidates}
    word = word.lstrip("-")
    same = [c for c in bare if _squashed(c) == _squashed(word) or _swapped(c, word)]
    found = same + [f for f in difflib.get_close_matches(word, list(bare), n=2, cutoff=cutoff)
                    if f not in same]
    return [bare[f] for f in found[:2]]


def _squashed(name: str) -> str:
    return name.replace("-", "").replace("_", "").lower()


def _swapped(a: str, b: str) -> bool:
    """Whether ``b`` is ``a`` with two neighbouring letters swapped."""
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return (len(a) == len(b) >= 3 and len(diff) == 2 and diff[1] == diff[0] + 1
            and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]])


def _either(names: Sequence[str], quote: bool = False) -> str:
    shown = [f"'{n}'" if quote else n for n in names]
    return " or ".join(shown)


class HpcParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` without prefix abbreviations whose errors suggest
    the closest valid choice (subparsers made from it are of this class too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Adds ``did you mean ...?`` to an invalid choice, then exits 2 as argparse does."""
        m = re.search(r"invalid choice: '([^']*)'", message)
        if m:
            choices = [str(c) for a in self._actions if a.choices for c in a.choices]
            similar = close_matches(m.group(1), choices, cutoff=0.6)
            if similar:
                message += f"; did you mean {_either(similar, quote=True)}?"
        super().error(message)

    def option_names(self) -> list[str]:
        """Every option string this parser knows (``--nproc-per-node``, ``-N``, ...)."""
        return [o for a in self._actions for o in a.option_strings]


def options_before_command(parser: HpcParser, argv: Sequence[str]) -> str | None:
    """The error for options given before the subcommand (``hpc --nodes 2 run train.py``),
    which argparse reports as an invalid command ``'2'``; None when ``argv`` is not that."""
    commands = next((list(a.choices) for a in parser._actions
                     if isinstance(a, argparse._SubParsersAction)), [])
    at = next((i for i, w in enumerate(argv) if w in commands), None)
    before = list(argv[:at]) if at else []
    if not before or not _is_option(before[0]) or before[0] in parser.option_names():
        return None
    fixed = shlex.join(["hpc", argv[at], *before, *argv[at + 1:]])
    return (f"{' '.join(before)}: options go after the command ({argv[at]}), as in: {fixed}")


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``command`` of ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    raise KeyError(command)


def unknown_arguments(parser: HpcParser, extras: Sequence[str], argv: Sequence[str],
                      script_args: Sequence[str] = ()) -> str:
    """The error for arguments ``parser`` does not know (pure).

    Args:
        parser: The subcommand's parser (its options are the candidates).
        extras: The arguments it did not recognise, in order.
        argv: The command line before ``--``, the subcommand first (``["run", "train.py", ...]``).
        script_args: The arguments given after ``--``.

    Returns:
        ``unrecognized arguments: ...``, then one line per unknown option that is close to a
        known one (``did you mean``), then, for the rest when the command runs a script, the
        command rewritten with them after ``--``.
    """
    lines = [f"unrecognized arguments: {' '.join(extras)}"]
    options = parser.option_names()
    fixes: dict[str, str] = {}          # a typo -> the option it most likely meant
    own: list[str] = []                 # the rest: probably the script's own arguments
    value_of_typo = False
    for word in extras:
        name = word.split("=", 1)[0]
        similar = close_matches(name, options) if _is_option(word) else []
        if similar:
            lines.append(f"  {name}: did you mean {_either(similar)}?")
            fixes[word] = similar[0] + word[len(name):]
        elif not (value_of_typo and not _is_option(word)):
            own.append(word)
        value_of_typo = bool(similar) and "=" not in word
    runs_script = any(a.dest == "script" for a in parser._actions)
    # After a typo, a stray positional is most likely the typo's value, shifted: no hint then.
    if runs_script and own and (not fixes or any(_is_option(w) for w in own)):
        first = next((w for w in own if _is_option(w)), own[0])
        kept = list(argv)
        for word in (w for w in reversed(own) if w in kept):
            del kept[len(kept) - 1 - kept[::-1].index(word)]
        kept = [fixes.get(w, w) for w in kept]
        rewritten = shlex.join([parser.prog.split()[0], *kept, "--", *own, *script_args])
        lines.append(f"  {parser.prog} does not take {first.split('=', 1)[0]}. If it is your "
                     "script's own argument, put the script's arguments after --: "
                     f"{rewritten}")
    return "\n".join(lines)


def _is_option(word: str) -> bool:
    return word.startswith("-") and word != "-"
