"""engine/job/files.py: the one way to read a file a user named without trusting it."""
import os

import pytest

from ringpipe.engine.job import files


def test_regular_json_is_read(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('{"x": [1, 2]}')
    assert files.read_json(str(path), "the manifest") == {"x": [1, 2]}


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_special_files_are_refused_at_once(tmp_path, kind):
    path = tmp_path / "data.json"
    if kind == "fifo":
        os.mkfifo(path)                     # opening it without O_NONBLOCK would wait forever
    elif kind == "device":
        os.symlink("/dev/zero", path)       # read whole, it would never end
    else:
        path.mkdir()
    with pytest.raises(files.UnreadableFile, match="not a regular file"):
        files.read_json(str(path), "the manifest")


def test_missing_and_too_large(tmp_path):
    with pytest.raises(files.UnreadableFile, match="does not exist"):
        files.read_json(str(tmp_path / "none.json"), "the manifest")
    big = tmp_path / "big.json"
    big.write_text(" " * 2000 + "{}")
    with pytest.raises(files.UnreadableFile, match="more than the 1,000"):
        files.read_json(str(big), "the manifest", limit=1000)


@pytest.mark.parametrize("text, why", [("[" * 100000 + "]" * 100000, "nested too deeply"),
                                       (b'{"a": "\xff"}', "not UTF-8"), ('{"a": ', "not valid JSON")])
def test_bad_json_is_a_value_error_naming_the_file(tmp_path, text, why):
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=why) as e:
        files.read_json(str(path), "the config")
    assert str(path) in str(e.value)


def test_no_follow_refuses_a_symlink(tmp_path):
    target = tmp_path / "target"
    target.write_text("x")
    link = tmp_path / "link"
    os.symlink(target, link)
    with pytest.raises(files.UnreadableFile, match="symbolic link"):
        files.open_regular(str(link), "the lock", follow_symlinks=False)
