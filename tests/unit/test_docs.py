"""The README and docs/: the generated flags page is current, every relative link resolves, the README stays short.

Fast: the flags page is rendered from the argparse parsers alone (no model, no engine).
"""
import glob
import importlib.util
import os
import re

from _support import ROOT

README_MAX_LINES = 150


def _make_flags_doc():
    spec = importlib.util.spec_from_file_location("make_flags_doc", os.path.join(ROOT, "scripts", "make_flags_doc.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pages() -> list:
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


# [text](target) and ![alt](target), the target up to whitespace or ')'; reference definitions `[x]: target`
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)


def _links(text: str) -> list:
    text = _FENCE.sub("", text)  # links inside code are not links
    text = _CODE.sub("", text)
    return _INLINE.findall(text) + _REFDEF.findall(text)


def test_flags_page_is_current():
    mod = _make_flags_doc()
    with open(os.path.join(ROOT, "docs", "flags.md"), encoding="utf-8") as f:
        current = f.read()
    assert current == mod.render(), ("docs/flags.md is out of date with the command-line help: "
                                     "run `python scripts/make_flags_doc.py`")


def test_flags_page_lists_every_flag_of_the_three_entry_points():
    mod = _make_flags_doc()
    text = mod.render()
    for _, prog, _ in mod.ENTRY_POINTS:
        assert f"`{prog}`" in text
    for flag in ("--actor_learning_rate", "--kl_coef", "--data_path", "--offload", "--margin", "--response_column"):
        assert f"`{flag}`" in text, flag


def test_every_relative_link_points_to_an_existing_file():
    broken = []
    for page in _pages():
        with open(page, encoding="utf-8") as f:
            text = f.read()
        for target in _links(text):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
                continue  # http(s):, mailto: ...; anchors within the page
            path = target.split("#", 1)[0].split("?", 1)[0]
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), path))
            if not os.path.exists(resolved):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_the_link_finder_sees_links_and_ignores_code():
    text = "a [x](docs/a.md) b ![img](p.png) `[no](code.md)`\n```\n[no](fenced.md)\n```\n[r]: ref.md\n"
    assert sorted(_links(text)) == ["docs/a.md", "p.png", "ref.md"]


def test_readme_is_short():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        n = len(f.read().splitlines())
    assert n <= README_MAX_LINES, (f"README.md has {n} lines (at most {README_MAX_LINES}): move reference material "
                                   "to a docs/ page and link it from the README")
