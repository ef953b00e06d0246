"""The secrets policy: credentials are never written down by hpc-elastic.

``jobspec.json``, the rendered batch script and the launcher's log record a job's ``--env``
values and the script's arguments, in a job directory that may be shared or backed up. A
credential put there outlives the job. So the policy is: secrets travel only through the
submitting shell's environment (sbatch ``--export=ALL`` carries it to the job), and anything
that looks like a secret on its way into the spec is refused before anything is created:

* ``--env NAME=VALUE`` with a secret-looking NAME (``WANDB_API_KEY``, ``HF_TOKEN``,
  ``DB_PASSWORD``...), whatever the value;
* an ``--env`` value or a script argument that holds the value of a secret-named variable of
  the environment (the shell expanded ``$WANDB_API_KEY`` into the command line);
* a script flag named for a credential (``--api-key``, ``--hf-token``, ``--password``,
  ``--secret``, a bare ``--key``/``--token``/``--pass``) given any value but a number
  (``--key 3``) or nothing;
* a script flag that only ends like one (``--bos-token``, ``--sort-key``, ``--first-pass``:
  tokenizer and data options in ordinary training scripts) given a credential-like value (long,
  one word, letters and digits mixed). Flags that merely contain such a word
  (``--max-tokens``, ``--tokenizer``, ``--password-file``) are not secret-named at all;
* any argument or ``--env`` value in a credential's own format, whatever flag it follows
  (``-p sk-proj-...``, a bare ``sk-...``, ``ghp_...``, ``hf_...``, ``AKIA...``, ``xoxb-...``),
  or holding a URL with a password (``postgres://user:pw@host/db``);
* the value of any variable that holds such a URL (``DATABASE_URL``) or whose name is a
  personal access token's (``GH_PAT``).

Pure apart from reading ``os.environ`` when no environment is passed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from hpc.contract import spec_terms
from hpc.contract.errors import SpecError

if TYPE_CHECKING:
    from hpc.contract.jobspec import JobSpec

# Names that hold credentials: WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY, DB_PASSWORD...
_SECRET_NAME = re.compile(r"(^|_)(API_?KEY|KEY|TOKEN|SECRET|PASSWORD|PASSWD|PASS|PAT|CREDENTIALS?)$"
                          r"|^WANDB_API_KEY$", re.IGNORECASE)
# Flag names (dashes as underscores) that name a credential and nothing else.
_CREDENTIAL_FLAG = re.compile(
    r"^(KEY|TOKEN|PASS|SECRET|PASSWORD|PASSWD|CREDENTIALS?)$"
    r"|(^|_)(API_?KEY|ACCESS_?KEY|SECRET_?KEY|PRIVATE_?KEY|AUTH_?KEY|WANDB_?KEY|"
    r"(API|ACCESS|AUTH|REFRESH|BEARER|HF|HUGGINGFACE|GITHUB|GH|GITLAB|SLACK|OAUTH)_?TOKEN|"
    r"SECRET|PASSWORD|PASSWD|CREDENTIALS?)$", re.IGNORECASE)
# Values a credential flag may take: plain ASCII numbers (--key 3, --pass 2, --token -1).
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
# A value that looks like a credential: long, one word, letters and digits mixed.
_CREDENTIAL_VALUE = re.compile(r"^(?=.*[0-9])(?=.*[A-Za-z])[A-Za-z0-9_\-.+/=:]{16,}$")
# Credentials in their issuers' own formats: recognisable after any flag, or none.
_CREDENTIAL_FORMAT = re.compile(
    r"(?<![A-Za-z0-9])(?:"
    r"sk-(?:proj-|ant-|live-|test-)?(?=[A-Za-z_-]*[0-9])[A-Za-z0-9_-]{16,}"            # OpenAI, Anthropic, Stripe
    r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"     # GitHub
    r"|glpat-[A-Za-z0-9_-]{20,}"                                    # GitLab
    r"|hf_[A-Za-z0-9]{20,}"                                         # Hugging Face
    r"|xox[abprs]-[A-Za-z0-9-]{10,}"                                # Slack
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}"                                   # AWS access key id
    r"|eyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]+"  # a JWT
    r")")
# A URL with a password in it: scheme://user:password@host.
_URL_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:[^/\s@]+@")
# Shorter values of secret-named variables are not looked for (they would match by chance).
_MIN_SECRET_LEN = 8


def is_secret_name(name: str) -> bool:
    """True for environment variable names that conventionally hold credentials."""
    return bool(_SECRET_NAME.search(name))


def looks_like_credential(value: str) -> str | None:
    """What kind of credential ``value`` holds by its format alone, or None (pure)."""
    if _URL_PASSWORD.search(value):
        return "a URL with a password"
    if _CREDENTIAL_FORMAT.search(value):
        return "a credential (by its format)"
    return None


def _secret_values(environ: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in environ.items()
            if len(value) >= _MIN_SECRET_LEN and (is_secret_name(name) or looks_like_credential(value))}


def secret_in_args(args: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """Describes the first script argument that carries a secret, or None (pure).

    Four rules (see the module docstring): an argument holding the value of a secret-named
    variable of ``environ``; a credential flag (``--api-key``, ``--hf-token``...) given a value
    that is not a number; any other secret-named flag (``--bos-token``) given a
    credential-like value; any argument in a credential's own format. ``--key 3``, ``--max-tokens 4096`` and ``--pad-token "<pad>"`` pass.
    """
    secrets = _secret_values(environ)
    for i, arg in enumerate(args):
        for name, value in secrets.items():
            if value in arg:
                return f"script argument {i + 1} holds the value of ${name}"
    for i, arg in enumerate(args):
        if not arg.startswith("-") or _NUMBER.fullmatch(arg):
            continue
        flag, eq, inline = arg.partition("=")
        if eq:
            value = inline
        else:
            nxt = args[i + 1] if i + 1 < len(args) else ""
            # The next argument is this flag's value unless it is another flag (a switch).
            value = "" if nxt.startswith("-") and not _NUMBER.fullmatch(nxt) else nxt
        name = flag.lstrip("-").replace("-", "_")
        if not value or _NUMBER.fullmatch(value) or not is_secret_name(name):
            continue
        if _CREDENTIAL_VALUE.match(value):
            return f"script argument {flag} is given a credential-like value"
        if _CREDENTIAL_FLAG.search(name):
            return (f"script argument {flag} is given a value that is not a number, and its "
                    "name is secret-like")
    for i, arg in enumerate(args):   # whatever flag it follows (-p sk-proj-...), or none
        kind = looks_like_credential(arg)
        if kind:
            return f"script argument {i + 1} holds {kind}"
    return None


def secret_in_env(env: Sequence[tuple[str, str]], environ: Mapping[str, str]) -> str | None:
    """Describes the first ``--env`` value that holds a secret of ``environ``, or None (pure)."""
    secrets = _secret_values(environ)
    for var, value in env:
        for name, secret in secrets.items():
            if secret in value:
                return f"--env {var} holds the value of ${name}"
        kind = looks_like_credential(value)
        if kind:
            return f"--env {var} holds {kind}"
    return None


def check_no_secrets(spec: JobSpec, environ: Mapping[str, str] | None = None) -> None:
    """Refuses secrets where they would be written down: ``spec.env`` and the script's arguments.

    Both are written into ``jobspec.json`` (and the arguments into the sbatch script and logs).
    Error messages never repeat the secret.

    Raises:
        SpecError: naming the variable or argument and how to pass it instead.
    """
    environ = os.environ if environ is None else environ
    env, args = spec_terms.pick("--env", "env"), spec_terms.pick("SCRIPT_ARGS", "script_args")
    secret = sorted(name for name, _ in spec.env if is_secret_name(name))
    if secret:
        names = ", ".join(secret)
        raise SpecError(
            env, names, f"not a secret: {env} values are written into jobspec.json and logs",
            f"export {secret[0]}=... && hpc submit train.py",
            f"Export {names} in your shell instead: the job inherits the submitting environment "
            "(sbatch --export=ALL) and hpc-elastic never writes it to disk")
    found = secret_in_env(spec.env, environ)
    if found:
        raise SpecError(
            env, f"<{found}>", f"no secrets: {env} values are written into jobspec.json and "
            "the launcher's log", "export WANDB_API_KEY=... && hpc submit train.py",
            "Leave the secret in your shell's environment: the job inherits it (sbatch "
            "--export=ALL) and hpc-elastic never writes it to disk")
    found = secret_in_args(spec.script_args, environ)
    if found:
        raise SpecError(
            args, f"<{found}>", "no secrets: script arguments are written into "
            "jobspec.json, the sbatch script and the logs", "export WANDB_API_KEY=... && hpc submit "
            "train.py -- --lr 3e-4",
            "Export the secret in your shell and read it from the environment in the script "
            "(the job inherits it; hpc-elastic never writes it to disk)")
