"""scripts/uv_args.py: the package sources pip is configured with, handed to uv (scripts/install.sh installs with uv,
which reads no pip configuration; the CPU torch build may lie only in a folder pip's configuration names); and the
bytecode a lazy install (scripts/test.sh) skips is written by the test processes."""
import os
import subprocess
import sys

import pytest

from tests._support import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
from uv_args import uv_args  # noqa: E402

# what `pip config list` printed on the development machine, plus an index-url from the environment
LINES = [
    ":env:.cert='/etc/ssl/certs/ca-certificates.crt'",
    ":env:.default-timeout='180'",
    ":env:.find-links='/opt/wheels'",
    ":env:.index-url='https://mirror.example/simple'",
    "global.cert='/etc/ssl/certs/other.crt'",
    "global.constraint='/etc/xdg/pip/constraints.txt'",
    "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'",
    "global.find-links='/opt/wheels'",
    "global.index-url='https://pypi.org/simple'",
]


def test_every_source_pip_knows_reaches_uv_once_and_the_environment_wins_single_values():
    assert uv_args(LINES) == [
        "--index-strategy", "unsafe-best-match",
        "--index-url", "https://mirror.example/simple",
        "--find-links", "/opt/wheels",
        "--extra-index-url", "file:///opt/pypi/simple", "--extra-index-url", "file:///opt/pypi-more/simple",
        "--constraint", "/etc/xdg/pip/constraints.txt",
        "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
    ]


def test_no_configuration_gives_pip_s_index_rule_only():
    assert uv_args([]) == ["--index-strategy", "unsafe-best-match"]


def test_the_script_reads_pip_config_list_from_stdin():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "uv_args.py")], input="\n".join(LINES[5:7]),
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["--index-strategy", "unsafe-best-match", "--extra-index-url", "file:///opt/pypi/simple",
                   "--extra-index-url", "file:///opt/pypi-more/simple", "--constraint", "/etc/xdg/pip/constraints.txt"]


def test_where_the_install_skipped_bytecode_the_test_processes_write_it():
    """scripts/test.sh installs without compiling every file (RLHF_INSTALL_BYTECODE=lazy) and lets its processes write
    bytecode as they import; were PYTHONDONTWRITEBYTECODE left set, every process would compile its imports from
    source again (deepspeed, transformers: seconds each). Run outside scripts/test.sh, there is nothing to check."""
    if os.environ.get("RLHF_INSTALL_BYTECODE") != "lazy":
        pytest.skip("not run by scripts/test.sh")
    assert not sys.flags.dont_write_bytecode and not os.environ.get("PYTHONDONTWRITEBYTECODE")
