"""Anyone who can write the run dir (a group-writable output dir on a cluster) may plant a link
where the library writes: its files are never written through one."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from otel_train.run_directory import LineFile, replace_whole, write_json


def test_a_link_planted_at_the_temporary_name_is_replaced_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched")
    path = tmp_path / "run" / "collectives.rank0.json"
    path.parent.mkdir()
    # the writer's temporary name, as one who knows its pid and thread would plant it
    (path.parent / f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp").symlink_to(victim)
    write_json(path, {"written_at": 1.0})
    replace_whole(path.with_name("stacks.rank0.0.txt"), "stacks")
    assert victim.read_text() == "untouched"
    assert path.read_text().startswith("{") and path.with_name("stacks.rank0.0.txt").read_text() == "stacks"
    assert sorted(p.name for p in path.parent.iterdir()) == ["collectives.rank0.json", "stacks.rank0.0.txt"]


def test_a_line_file_refuses_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched")
    (tmp_path / "events.rank0.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        LineFile(tmp_path / "events.rank0.jsonl")
    assert victim.read_text() == "untouched"
