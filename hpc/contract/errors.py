"""User-facing errors.

A ``SpecError`` is raised for any invalid value a user gave (flag, config key, environment).
It carries what was given, what is valid and an example, so the CLI can print one clear
message and exit with status 2 before anything is created or submitted.
"""

from __future__ import annotations


class SpecError(ValueError):
    """An invalid user-supplied value.

    Args:
        flag: The flag or config key the value came from, e.g. ``--nodes``.
        value: The value as the user gave it.
        valid: The valid form, in words.
        example: A valid example, as the user would type it.
        hint: Optional extra advice (what to do next).
    """

    def __init__(self, flag: str, value: object, valid: str, example: str, hint: str = "") -> None:
        self.flag = flag
        self.value = value
        self.valid = valid
        self.example = example
        self.hint = hint
        msg = f"{flag} {value!r} is invalid: {valid}. Example: {example}"
        if hint:
            msg += f". {hint}"
        super().__init__(msg)


class HpcError(RuntimeError):
    """An operational failure the user should read (Slurm refused, job dir unusable, ...)."""


class UsageError(HpcError):
    """A request that cannot be carried out as given (Slurm refused it, the job directory is
    in use): the CLI prints the message and exits with status 2, like a :class:`SpecError`."""
