"""kvlab.files: a file or a folder is replaced whole or not at all, and readable as the umask says."""

import os
import stat

import pytest

from kvlab.files import read_json, write_atomic, write_directory, write_json


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = write_json(tmp_path / "r.json", {"a": 1})

    def boom(handle):
        handle.write(b"half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        write_atomic(path, boom)
    assert read_json(path) == {"a": 1} and os.listdir(tmp_path) == ["r.json"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_folder_is_replaced_whole_and_a_failed_fill_keeps_the_old_one(tmp_path):
    out = tmp_path / "model"
    write_directory(out, lambda staging: (staging / "config.json").write_text("1"))
    write_directory(out, lambda staging: (staging / "weights").write_text("2"))
    assert sorted(os.listdir(out)) == ["weights"] and os.listdir(tmp_path) == ["model"]

    def boom(staging):
        (staging / "half").write_text("x")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        write_directory(out, boom)
    assert sorted(os.listdir(out)) == ["weights"] and os.listdir(tmp_path) == ["model"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask  # not mkdtemp's 0700
