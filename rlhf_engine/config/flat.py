"""Flat keys: a nested config seen as the flags and config-file keys users write."""
from __future__ import annotations

import dataclasses
from typing import Any

from .role import RoleConfig


# ---- flat keys (flags, config files, config.json) ---------------------------------------------------------------
def flat_fields(cfg: Any) -> dict[str, tuple[Any, dataclasses.Field, str, str]]:
    """flat key -> (owner object, field, help-group title, help-group text) for every leaf field of the config.

    The flat key is the flag and config-file key: a nested section's fields are prefixed by its field's
    `flag_prefix` metadata (default `<field>_` for a `RoleConfig`, nothing otherwise); `skip_flags` leaves fields
    out."""
    out: dict[str, tuple[Any, dataclasses.Field, str, str]] = {}

    def put(key: str, owner: Any, f: dataclasses.Field, title: str, doc: str) -> None:
        if key in out:  # two sections with the same field name would silently share one flag
            raise RuntimeError(f"config key {key!r} is defined twice; rename one of the fields")
        out[key] = (owner, f, title, doc)

    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(value):
            put(f.name, cfg, f, type(cfg).__name__, (type(cfg).__doc__ or "").strip())
            continue
        is_role = isinstance(value, RoleConfig)
        prefix = f.metadata.get("flag_prefix", f"{f.name}_" if is_role else "")
        skip = set(f.metadata.get("skip_flags", ()))
        if is_role:  # one group per role, not one "RoleConfig" group holding all four
            title = f"{f.name} role" if prefix else f.name
            doc = f"{f.metadata.get('help', '')} Flags: --{prefix}<field>."
        else:
            title, doc = type(value).__name__, (type(value).__doc__ or "").strip()
        for g in dataclasses.fields(value):
            if g.name not in skip:
                put(f"{prefix}{g.name}", value, g, title, doc)
    return out


def flat_dict(cfg: Any) -> dict:
    """The resolved config as flat keys (what a config file, config.json and wandb's config hold)."""
    return {k: getattr(owner, f.name) for k, (owner, f, _, _) in flat_fields(cfg).items()}
