"""hvd_lm.util.atomic: a failed write leaves the old file and no temporary file behind."""
import pytest

from hvd_lm.util.atomic import atomic_path, write_text


def test_write_replaces_and_failure_keeps_old(tmp_path):
    target = tmp_path / "f.json"
    write_text(target, "old\n")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]
    write_text(target, "new\n")
    assert target.read_text() == "new\n" and len(list(tmp_path.iterdir())) == 1


def test_suffix_for_extension_adding_writers(tmp_path):
    import numpy as np

    with atomic_path(tmp_path / "a.npy", suffix=".npy") as tmp:
        np.save(tmp, np.arange(3))
    assert np.load(tmp_path / "a.npy").tolist() == [0, 1, 2]
    assert len(list(tmp_path.iterdir())) == 1
