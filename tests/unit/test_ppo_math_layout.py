"""rlhf_engine.ppo_math is a package of small modules, one per concern: each stays under 200 lines (what the split
promised), and every name the rest of the repository imports from it (or reads as `ppo_math.X`) is still
importable from the package."""
import ast
import glob
import importlib
import os

import pytest

from _support import ROOT

PACKAGE = os.path.join(ROOT, "rlhf_engine", "ppo_math")
MAX_LINES = 200
# the names imported from ppo_math across the repository when it became a package (the scan below finds new ones)
KNOWN = ("KL_ESTIMATORS", "LOSS_AGG_MODES", "RENAMED_CORRECTIONS", "ROLLOUT_CORRECTIONS", "STOP_MASK_VALUE",
         "AdaptiveKLController", "FixedKLController", "cispo_loss", "compute_gae", "compute_rewards",
         "entropy_from_logits", "gspo_loss", "kl_loss", "kl_penalty", "last_action_index",
         "logprobs_and_entropy_from_logits", "logprobs_from_logits", "loss_token_weights", "mask_stop_tokens_",
         "masked_whiten", "pairwise_loss", "policy_loss", "rollout_correction", "sft_loss", "value_loss")


def _modules():
    return sorted(glob.glob(os.path.join(PACKAGE, "*.py")))


def test_the_package_is_several_modules():
    assert not os.path.exists(os.path.join(ROOT, "rlhf_engine", "ppo_math.py"))
    assert len(_modules()) > 2


@pytest.mark.parametrize("path", _modules(), ids=os.path.basename)
def test_every_module_is_small_and_says_what_it_holds(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    n = len(text.splitlines())
    assert n < MAX_LINES, f"{os.path.relpath(path, ROOT)} has {n} lines: split it by concern"
    assert ast.get_docstring(ast.parse(text)), f"{os.path.relpath(path, ROOT)} has no module docstring"


def _imported_names() -> set:
    """Every `from <...>ppo_math import X` (absolute or relative) and `ppo_math.X` outside the package."""
    names = set()
    for top in ("rlhf_engine", "tests", "bench", "launch", "scripts", "examples"):
        for path in glob.glob(os.path.join(ROOT, top, "**", "*.py"), recursive=True):
            if os.path.commonpath([path, PACKAGE]) == PACKAGE:
                continue
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "ppo_math":
                    names |= {a.name for a in node.names}
                elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                      and node.value.id == "ppo_math"):
                    names.add(node.attr)
    return names


def test_the_scan_finds_the_imports():
    """Negative control of the scan: today's importers are seen (e.g. the trainer's KL controllers)."""
    found = _imported_names()
    assert {"AdaptiveKLController", "compute_rewards", "STOP_MASK_VALUE", "gspo_loss"} <= found, found


@pytest.mark.parametrize("name", sorted(set(KNOWN) | _imported_names()))
def test_every_imported_name_is_importable_from_the_package(name):
    pkg = importlib.import_module("rlhf_engine.ppo_math")
    assert hasattr(pkg, name), f"rlhf_engine.ppo_math.{name} is gone"
    if not name.startswith("_"):
        assert name in pkg.__all__, f"{name} is missing from rlhf_engine.ppo_math.__all__"
    exec(f"from rlhf_engine.ppo_math import {name}", {})


def test_all_names_only_what_the_package_has():
    pkg = importlib.import_module("rlhf_engine.ppo_math")
    assert len(set(pkg.__all__)) == len(pkg.__all__)
    assert [n for n in pkg.__all__ if not hasattr(pkg, n)] == []
