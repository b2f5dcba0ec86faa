"""Print, one per line, the `uv pip install` arguments that give uv the package sources pip is configured with.

    pip config list | python scripts/uv_args.py

uv reads neither pip.conf nor PIP_* variables, and a machine may keep its wheels (the CPU torch build among them)
in a local find-links folder or index that only pip's configuration names (scripts/install.sh). pip merges every
index it knows and takes the best version; `--index-strategy unsafe-best-match` is uv's name for the same rule.
A configured CA bundle becomes SSL_CERT_FILE=<path> on a line of its own (the caller exports it).
"""
import shlex
import sys

LISTS = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "constraint": "--constraint"}


def uv_args(config_lines: list[str]) -> list[str]:
    """`pip config list` lines (`global.find-links='/opt/wheels'`, `:env:.cert='...'`) -> uv arguments."""
    values: dict[str, list[str]] = {}
    for line in config_lines:
        key, sep, raw = line.strip().partition("=")
        if not sep:
            continue
        name = key.rsplit(".", 1)[-1]
        scope_env = key.startswith(":env:")
        items = shlex.split(raw)
        items = [v for item in items for v in item.split()]  # pip splits a list value on whitespace
        if name in ("index-url", "cert") and scope_env:
            values[name] = items  # the environment overrides a file's single value
        else:
            values.setdefault(name, [])
            values[name] += [v for v in items if v not in values[name]]
    args = ["--index-strategy", "unsafe-best-match"]
    if values.get("index-url"):
        args += ["--index-url", values["index-url"][0]]
    for name, flag in LISTS.items():
        for v in values.get(name, []):
            args += [flag, v]
    if values.get("cert"):
        args.append(f"SSL_CERT_FILE={values['cert'][0]}")
    return args


if __name__ == "__main__":
    print("\n".join(uv_args(sys.stdin.read().splitlines())))
