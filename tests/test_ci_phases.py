"""``make test-all``'s second phase collects only the files that name its markers: a test marked
``faults`` / ``multinode`` / ``serial`` from another file's variable would be silently skipped,
so the root conftest refuses it at collection."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from tests.shared import check_serial_marks_are_in_their_files


@dataclasses.dataclass
class Item:
    path: pathlib.Path
    marks: tuple[str, ...]
    nodeid: str = "t.py::test_x"

    def iter_markers(self):
        return [pytest.mark.__getattr__(m).mark for m in self.marks]


def test_a_test_marked_in_its_own_file_passes(tmp_path):
    path = tmp_path / "test_a.py"
    path.write_text("pytestmark = [pytest.mark.faults]\n")
    check_serial_marks_are_in_their_files([Item(path, ("faults", "slow"))])


def test_a_mark_its_file_does_not_name_is_refused(tmp_path):
    path = tmp_path / "test_b.py"
    path.write_text("from shared import MARKS\npytestmark = MARKS\n")
    with pytest.raises(pytest.UsageError, match="marked 'multinode' but test_b.py"):
        check_serial_marks_are_in_their_files([Item(path, ("multinode",))])
