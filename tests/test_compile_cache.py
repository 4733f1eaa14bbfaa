"""Where compiled kernels go, and the error when they cannot go there."""
import os

import pytest

from gen.compile import cache_root, kernel_dir


def test_env_var_moves_the_whole_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path / "tm"))
    assert cache_root() == tmp_path / "tm"
    assert kernel_dir() == tmp_path / "tm" / "kernels" and kernel_dir().is_dir()


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_read_only_cache_names_the_fix(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(ro))
    with pytest.raises(PermissionError, match="TILEMARLIN_CACHE_DIR"):
        kernel_dir()


def test_a_file_in_the_way_names_the_fix(tmp_path, monkeypatch):
    (tmp_path / "kernels").write_text("not a folder")
    monkeypatch.setenv("TILEMARLIN_CACHE_DIR", str(tmp_path))
    with pytest.raises(PermissionError, match="TILEMARLIN_CACHE_DIR"):
        kernel_dir()
