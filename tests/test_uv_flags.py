"""``make setup`` installs with uv under pip's own configuration (``.ci/uv_flags.py``): a
``PIP_*`` variable wins over a file, lists give a flag per item, pip's index rule is kept."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from tests.shared import load_script

PATH = pathlib.Path(__file__).resolve().parents[1] / ".ci" / "uv_flags.py"
uv_flags = load_script(PATH, "uv_flags")


def test_pip_settings_become_uv_flags_the_variables_winning():
    listing = "\n".join([
        ":env:.default-timeout='180'",
        ":env:.find-links='/opt/env-wheels'",
        "global.cert='/etc/ssl/certs/ca-certificates.crt'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'",
        "global.find-links='/opt/wheels'",
        "user.index-url='https://ignored.example/simple'",
    ])
    settings = uv_flags.pip_settings(listing)
    assert settings == {"find-links": "/opt/env-wheels",
                        "constraint": "/etc/xdg/pip/constraints.txt",
                        "extra-index-url": "file:///opt/pypi/simple file:///opt/pypi-more/simple"}
    flags = uv_flags.uv_flags(settings)
    assert flags[-2:] == ["--index-strategy", "unsafe-best-match"]
    pairs = list(zip(flags[:-2:2], flags[1:-2:2]))
    assert sorted(pairs) == [("--constraints", "/etc/xdg/pip/constraints.txt"),
                             ("--extra-index-url", "file:///opt/pypi-more/simple"),
                             ("--extra-index-url", "file:///opt/pypi/simple"),
                             ("--find-links", "/opt/env-wheels")]


def test_no_pip_configuration_gives_only_the_index_rule():
    assert uv_flags.uv_flags(uv_flags.pip_settings("")) == ["--index-strategy",
                                                             "unsafe-best-match"]


def test_the_script_runs_with_this_environments_pip():
    out = subprocess.run([sys.executable, str(PATH)], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-2:] == ["--index-strategy", "unsafe-best-match"]
