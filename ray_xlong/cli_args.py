"""Argument checks of the ``ray-xlong`` command line, run by argparse before a command starts.

Each is an argparse ``type=``: a bad value ends the command at parse time (exit status 2, the
message names the argument: ``argument --steps: must be an int >= 1, got '0'``), before Ray
starts or a model is built. Only the standard library is imported here, so a bad argument is
reported in well under a second.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Callable, Sequence


class CliError(Exception):
    """A user error found after parsing (a preset, a mode, a file's content): printed without a
    traceback, exit status 2."""


def progress(items: Sequence, desc: str):
    """``items`` with a progress bar on stderr (when tqdm is installed)."""
    import sys

    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, leave=False, file=sys.stderr)


def int_at_least(low: int) -> Callable[[str], int]:
    """An int ``>= low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {text!r}")
        return value
    parse.__name__ = f"int>={low}"
    return parse


def port_number(text: str) -> int:
    """A TCP port: an int in 0..65535 (0: the system picks a free one)."""
    port = int_at_least(0)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0..65535), got {text!r}")
    return port


def existing_file(text: str) -> str:
    """A path to an existing file."""
    if not pathlib.Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def existing_dir(text: str) -> str:
    """A path to an existing directory."""
    if not pathlib.Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"no such directory: {text!r}")
    return text


def output_file(*suffixes: str) -> Callable[[str], str]:
    """A file to write: its folder exists (or can be created: no file in the way) and, when
    ``suffixes`` are given, its name ends in one of them."""
    def parse(text: str) -> str:
        path = pathlib.Path(text)
        if suffixes and not text.endswith(suffixes):
            raise argparse.ArgumentTypeError(f"must end in {' or '.join(suffixes)}, got {text!r}")
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
        _creatable(path.parent, text)
        return text
    parse.__name__ = "output file"
    return parse


def output_dir(text: str) -> str:
    """A directory to write into (exists, or can be created: no file in the way)."""
    path = pathlib.Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a directory")
    _creatable(path, text)
    return text


def key_value(text: str) -> str:
    """``section.field=value`` (the value is read as YAML later)."""
    key, sep, _ = text.partition("=")
    if not sep or "." not in key or not all(key.split(".")):
        raise argparse.ArgumentTypeError(f"expected section.field=value, got {text!r}")
    return text


def _creatable(folder: pathlib.Path, text: str) -> None:
    for part in (folder, *folder.parents):
        if part.exists():
            if not part.is_dir():
                raise argparse.ArgumentTypeError(f"cannot write {text!r}: {str(part)!r} is a "
                                                 f"file")
            return
