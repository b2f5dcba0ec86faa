"""Secret redaction for every file a run writes (and wandb's record of the command line): a leaf module.

`redact` replaces the value of every environment variable whose name contains KEY, TOKEN, SECRET, PASSWORD or PASSWD
(values of 6+ characters; TOKENIZERS_PARALLELISM is no secret) wherever it appears in a string, and the value of any
mapping key / command-line flag named like a secret (`api_key`, `hf_token`, `--wandb-api-key=...`, `client_secret`,
`password`; not `pad_token`-style special-token names).
"""
from __future__ import annotations

import os
import re
from typing import Any, Mapping, Optional, Sequence

REDACTED = "***"
SECRET_ENV_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD")
_NOT_SECRET_ENV = frozenset({"TOKENIZERS_PARALLELISM"})
_MIN_SECRET_LEN = 6  # shorter values ("1", "true") would match ordinary text everywhere
_SECRET_WORDS = frozenset({"key", "apikey", "token", "secret", "password", "passwd", "pwd"})
_SPECIAL_TOKENS = frozenset({"pad", "bos", "eos", "unk", "sep", "cls", "mask", "stop", "start", "end"})

# ---- redaction ---------------------------------------------------------------------------------------------------
def secret_values(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """Values of the secret-named environment variables (longest first, so a longer secret is replaced whole)."""
    env = os.environ if environ is None else environ
    vals = {v for k, v in env.items() if k.upper() not in _NOT_SECRET_ENV
            and any(w in k.upper() for w in SECRET_ENV_WORDS) and v and len(v.strip()) >= _MIN_SECRET_LEN}
    return sorted(vals, key=lambda v: (-len(v), v))


def is_secret_name(name: str) -> bool:
    """`api_key`, `WANDB_API_KEY`, `--hf-token`, `client_secret`, `password`: yes. `pad_token`, `stop_token_ids`,
    `tokenizer_name_or_path`: no."""
    words = [w for w in re.split(r"[^a-z0-9]+", str(name).lower()) if w]
    if not words or words[-1] not in _SECRET_WORDS:
        return False
    return not (words[-1] == "token" and len(words) > 1 and words[-2] in _SPECIAL_TOKENS)


def _redact_str(s: str, secrets: Sequence[str]) -> str:
    for v in secrets:
        if v in s:
            s = s.replace(v, REDACTED)
    return s


def redact(obj: Any, environ: Optional[Mapping[str, str]] = None, _secrets: Optional[list[str]] = None) -> Any:
    """A copy of `obj` (dicts, lists, tuples, strings, anything else as is) with secrets replaced by '***'."""
    secrets = secret_values(environ) if _secrets is None else _secrets
    if isinstance(obj, Mapping):
        return {k: REDACTED if is_secret_name(k) and isinstance(v, str) and v else redact(v, _secrets=secrets)
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v, _secrets=secrets) for v in obj)
    if isinstance(obj, str):
        return _redact_str(obj, secrets)
    return obj


def redact_argv(argv: Sequence[str], environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """A command line with secret values replaced: `--api_key X`, `--api_key=X` and any secret env value."""
    secrets = secret_values(environ)
    out, hide_next = [], False
    for a in map(str, argv):
        if hide_next and not a.startswith("--"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        if a.startswith("-"):
            name, eq, _ = a.partition("=")
            if is_secret_name(name):
                if eq:
                    out.append(f"{name}={REDACTED}")
                    continue
                hide_next = True
        out.append(_redact_str(a, secrets))
    return out
