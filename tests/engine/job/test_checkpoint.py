"""Checkpoint format: what is refused (and how clearly), what is skipped, what pruning keeps,
and what a full or read-only disk leaves behind."""
import errno
import glob
import hashlib
import io
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import tracemalloc
import zipfile
import zlib

import numpy as np
import pytest

from ringpipe.engine.job import checkpoint
from ringpipe.engine.job.checkpoint import CheckpointError

# ---- helpers -------------------------------------------------------------------------

def make_meta(**changes):
    """A manifest's metadata as the trainer writes it."""
    meta = {"model": "gpt", "model_config": {"n_layer": 1, "d_model": 4, "n_head": 2, "context": 8, "vocab": 256},
            "optimizer": "adamw", "opt_step_count": 12, "loss": 2.5, "dtype": "float32", "precision": "float32",
            "layout": {"dp": 1, "pp": 1, "chunks": 1}, "args": {"seed": 1337, "lr": 0.001, "data": None}}
    meta.update(changes)
    return meta


def make_arrays(seed=0, n=4):
    rng = np.random.default_rng(seed)
    return {"param/wte": rng.normal(size=(n, 3)).astype(np.float32),
            "param/h.0.attn.qkv.w": rng.normal(size=(3, 9)).astype(np.float32),
            "opt/m/wte": np.zeros((n, 3), np.float32),
            "opt/m/h.0.attn.qkv.w": np.zeros((3, 9), np.float32)}


def save(directory, step, keep=0, arrays=None):
    return checkpoint.save(str(directory), step, arrays if arrays is not None else make_arrays(step), make_meta(),
                           keep=keep)


def expected_shapes(arrays):
    return {k: v.shape for k, v in arrays.items()}


def canonical_checksum(manifest):
    """The documented rule, written out independently of the module."""
    fields = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def edit_manifest(path, fix_checksum=True, drop=(), **changes):
    """Change keys of a manifest, recomputing its checksum like a careful forger would."""
    with open(path) as fh:
        manifest = json.load(fh)
    manifest.update(changes)
    for key in drop:
        del manifest[key]
    if fix_checksum and "checksum" in manifest:
        manifest["checksum"] = canonical_checksum(manifest)
    with open(path, "w") as fh:
        json.dump(manifest, fh)


def replace_npz(json_path, content: bytes):
    """Put `content` in place of the npz and make the manifest's size, CRC and checksum
    agree with it: what remains to catch it is the check of the zip itself."""
    with open(json_path[:-5] + ".npz", "wb") as fh:
        fh.write(content)
    edit_manifest(json_path, npz_bytes=len(content), npz_crc32=zlib.crc32(content))


def npz_bytes(arrays, compressed=False):
    buffer = io.BytesIO()
    if compressed:
        np.savez_compressed(buffer, **arrays)
    else:
        np.savez(buffer, **arrays)
    return buffer.getvalue()


def npy_header(shape, descr="<f4"):
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def zip_of(members: dict):
    """A zip of raw (already .npy-encoded) members, stored uncompressed as np.savez does."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buffer.getvalue()


def write_raw_manifest(directory, step, content: bytes):
    path = os.path.join(str(directory), f"ckpt_{step:08d}.json")
    with open(path, "wb") as fh:
        fh.write(content)
    return path


@pytest.fixture
def no_hang():
    """Fail the test, rather than hang the suite, if a call blocks (e.g. on a FIFO)."""
    def on_alarm(signum, frame):
        raise TimeoutError("blocked for 10 s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# ---- round trip and format -------------------------------------------------------------

def test_round_trip_writes_format_2_with_checksum(tmp_path):
    arrays = make_arrays(1)
    path = save(tmp_path / "checkpoints", 12, arrays=arrays)
    assert path.endswith("ckpt_00000012.json")
    with open(path) as fh:
        manifest = json.load(fh)
    assert manifest["format"] == "ringpipe-checkpoint-2"
    assert manifest["checksum"] == canonical_checksum(manifest)
    assert manifest["npz"] == "ckpt_00000012.npz"
    # every way of naming it: the manifest, the npz, the folder, the run directory
    for where in (path, path[:-5] + ".npz", str(tmp_path / "checkpoints"), str(tmp_path)):
        loaded, manifest = checkpoint.load(where)
        assert manifest["step"] == 12 and manifest["opt_step_count"] == 12
        assert loaded.keys() == arrays.keys()
        for name in arrays:
            np.testing.assert_array_equal(loaded[name], arrays[name])
            assert loaded[name].dtype == arrays[name].dtype
    assert checkpoint.inspect(path) is None
    assert checkpoint.scan(str(tmp_path / "checkpoints")) == ([path], [])


def test_numpy_scalars_in_meta_are_written_as_plain_json(tmp_path):
    # the trainer's loss is a NumPy float64
    path = checkpoint.save(str(tmp_path), 1, make_arrays(), make_meta(loss=np.float64(1.25)))
    assert checkpoint.read_manifest(path)["loss"] == 1.25


def test_fortran_order_and_other_dtypes_round_trip(tmp_path):
    arrays = {"param/f": np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
              "param/i": np.arange(5, dtype=np.int32), "param/s": np.float32(3.0).reshape(()),
              "opt/empty": np.zeros((0, 4), np.float32)}
    path = save(tmp_path, 3, arrays=arrays)
    loaded, _ = checkpoint.load(path)
    for name, value in arrays.items():
        np.testing.assert_array_equal(loaded[name], value)
        assert loaded[name].shape == value.shape and loaded[name].dtype == value.dtype


def test_format_1_files_still_load(tmp_path):
    path = save(tmp_path, 4)
    edit_manifest(path, fix_checksum=False, drop=("checksum",), format="ringpipe-checkpoint-1")
    arrays, manifest = checkpoint.load(path)
    assert manifest["format"] == "ringpipe-checkpoint-1" and "param/wte" in arrays
    # the oldest format-1 files have no precision or layout
    edit_manifest(path, fix_checksum=False, drop=("precision", "layout"))
    assert checkpoint.inspect(path) is None
    # ... but their schema is still checked
    edit_manifest(path, fix_checksum=False, step="4")
    with pytest.raises(CheckpointError, match=r"'step' holds \"4\" \(a string\)"):
        checkpoint.load(path)


def test_read_manifest_does_not_touch_the_arrays(tmp_path):
    path = save(tmp_path, 7)
    os.remove(path[:-5] + ".npz")
    assert checkpoint.read_manifest(path)["model_config"]["n_head"] == 2
    with pytest.raises(CheckpointError, match="ckpt_00000007.npz is missing"):
        checkpoint.load(path)


def test_missing_checkpoint_says_so(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load(str(tmp_path / "ckpt_00000001.json"))
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        checkpoint.load(str(tmp_path))


# ---- 1: the manifest is not trusted ---------------------------------------------------------

def test_edited_step_is_refused(tmp_path):
    path = save(tmp_path, 12)
    edit_manifest(path, fix_checksum=False, step=5)
    with pytest.raises(CheckpointError, match="checksum does not match.*--resume auto skips damaged ones"):
        checkpoint.load(path)
    # with the checksum recomputed, the file name still says 12
    edit_manifest(path, step=5)
    with pytest.raises(CheckpointError, match="says step 5 but its file name says step 12"):
        checkpoint.load(path)
    assert "file name says step 12" in checkpoint.inspect(path)


def test_edited_model_config_is_refused(tmp_path):
    path = save(tmp_path, 12)
    manifest = checkpoint.read_manifest(path)
    edit_manifest(path, fix_checksum=False, model_config=dict(manifest["model_config"], n_layer=6))
    with pytest.raises(CheckpointError, match="checksum"):
        checkpoint.read_manifest(path)
    assert checkpoint.find_latest(str(tmp_path)) is None


@pytest.mark.parametrize("npz", ["/etc/passwd", "../elsewhere/ckpt_00000012.npz", "ckpt_00000003.npz",
                                 "ckpt_00000012.npz/"])
def test_npz_must_be_the_manifests_own_name(tmp_path, npz):
    save(tmp_path, 3)
    path = save(tmp_path, 12)
    edit_manifest(path, npz=npz)
    with pytest.raises(CheckpointError, match=r"names the npz .*expected 'ckpt_00000012.npz'"):
        checkpoint.load(path)


def test_renamed_manifest_is_refused(tmp_path):
    path = save(tmp_path, 12)
    shutil.copy(path, tmp_path / "best.json")
    with pytest.raises(CheckpointError, match="is not ckpt_XXXXXXXX.json"):
        checkpoint.load(str(tmp_path / "best.json"))


@pytest.mark.parametrize("change,message", [
    ({"step": "12"}, r"'step' holds \"12\" \(a string\), expected an integer from 0 to 99999999"),
    ({"step": True}, r"'step' holds true \(a boolean\), expected an integer"),
    ({"step": 12.0}, r"'step' holds 12.0 \(a number\), expected an integer"),
    ({"opt_step_count": -1}, r"'opt_step_count' holds -1 \(an integer\), expected an integer from 0"),
    ({"npz_crc32": 2**32}, r"'npz_crc32' holds 4294967296"),
    ({"model": "transformer"}, r"'model' holds \"transformer\" \(a string\), expected 'gpt' or 'llama' or 'mlp'"),
    ({"model_config": {"n_layer": 1}}, r"'model_config' holds .*expected an object with exactly the keys"),
    ({"model_config": {"n_layer": 0, "d_model": 4, "n_head": 2, "context": 8, "vocab": 256}},
     r"'model_config.n_layer' holds 0 \(an integer\), expected an integer from 1"),
    ({"loss": float("nan")}, r"'loss' holds NaN \(a number\), expected a finite number or null"),
    ({"layout": [1, 1, 1]}, r"'layout' holds \[1, 1, 1\] \(a list\), expected an object"),
    ({"optimizer": None}, r"'optimizer' holds null \(null\), expected a short name"),
    ({"args": "seed=1"}, r"'args' holds \"seed=1\" \(a string\), expected an object"),
    ({"checksum": "abc"}, r"'checksum' holds \"abc\" \(a string\), expected 64 lowercase hex"),
    ({"format": "something-else"}, r"'format' holds \"something-else\" \(a string\), expected 'ringpipe-checkpoint-3', 'ringpipe-checkpoint-2'"),
    ({"surprise": 1}, r"unknown key\(s\) surprise"),
])
def test_schema_names_the_key_its_value_and_what_was_expected(tmp_path, change, message):
    path = save(tmp_path, 12)
    # the checksum recomputed (unless it is what is changed): the schema is what must catch it
    edit_manifest(path, fix_checksum="checksum" not in change, **change)
    with pytest.raises(CheckpointError, match=message):
        checkpoint.load(path)
    assert checkpoint.inspect(path) is not None


def test_missing_key_is_named(tmp_path):
    path = save(tmp_path, 12)
    edit_manifest(path, drop=("opt_step_count",))
    with pytest.raises(CheckpointError, match=r"lacks the key\(s\) opt_step_count"):
        checkpoint.load(path)


# ---- 2: messages, not tracebacks -------------------------------------------------------------

@pytest.mark.parametrize("content,message", [
    (b"null", "holds null (null), expected a JSON object"),
    (b"[1, 2]", "holds [1, 2] (a list), expected a JSON object"),
    (b"", "not valid JSON"),
    (b'{"step": 1', "not valid JSON"),
    (b'{"format": "ringpipe-checkpoint-2", "step": 1, "step": 2}', "has the key 'step' twice"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[" * 200_000 + b"]" * 200_000, "not valid JSON"),
    (b'{"a": "' + b"x" * (65 << 20) + b'"}', "larger than 64 MiB"),
])
def test_unreadable_manifest_is_a_clear_error(tmp_path, content, message):
    path = write_raw_manifest(tmp_path, 1, content)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        checkpoint.load(path)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        checkpoint.read_manifest(path)
    assert message in checkpoint.inspect(path)


def test_npz_lacking_an_array_names_it(tmp_path):
    arrays = make_arrays()
    path = save(tmp_path, 2, arrays={k: v for k, v in arrays.items() if k != "param/h.0.attn.qkv.w"})
    wanted = expected_shapes(arrays)
    with pytest.raises(CheckpointError, match=r"lacks param/h.0.attn.qkv.w: was it written by a model with "
                                              "another configuration"):
        checkpoint.load(path, expected=wanted)
    wanted.update({"param/extra.1": (1,), "param/extra.2": (2,)})
    with pytest.raises(CheckpointError, match=r"lacks param/h.0.attn.qkv.w \(and 2 more\)"):
        checkpoint.load(path, expected=wanted)


def test_npz_with_a_wrong_shape_names_it(tmp_path):
    arrays = make_arrays(n=4)
    path = save(tmp_path, 2, arrays=arrays)
    wanted = expected_shapes(make_arrays(n=5))
    with pytest.raises(CheckpointError, match=r"param/wte has shape \(4, 3\), the model expects \(5, 3\)"):
        checkpoint.load(path, expected=wanted)


def test_expected_reads_only_those_arrays(tmp_path):
    arrays = make_arrays()
    path = save(tmp_path, 2, arrays=arrays)
    wanted = {"param/wte": (4, 3)}
    loaded, _ = checkpoint.load(path, expected=wanted)
    assert list(loaded) == ["param/wte"]
    np.testing.assert_array_equal(loaded["param/wte"], arrays["param/wte"])


def test_huge_declared_shape_is_refused_before_allocating(tmp_path):
    path = save(tmp_path, 2)
    header = npy_header((10**6, 10**6))
    replace_npz(path, zip_of({"param/wte.npy": header + b"\0" * 64}))
    problem = checkpoint.inspect(path)
    assert "declares shape (1000000, 1000000) of float32 (4000000000000 bytes) but holds 64 bytes" in problem
    with pytest.raises(CheckpointError, match="declares shape"):
        checkpoint.load(path)
    with pytest.raises(CheckpointError, match="declares shape"):
        checkpoint.load(path, expected={"param/wte": (10**6, 10**6)})


def test_npy_header_disagreeing_with_the_zip_size_is_refused(tmp_path):
    path = save(tmp_path, 2)
    replace_npz(path, zip_of({"param/wte.npy": npy_header((10,)) + b"\0" * 80}))      # 40 bytes declared
    assert "declares shape (10,) of float32 (40 bytes) but holds 80 bytes" in checkpoint.inspect(path)


# ---- 3: a matching CRC is not enough -------------------------------------------------------

def test_valid_crc_but_not_a_zip_falls_back_to_the_previous(tmp_path):
    good = save(tmp_path, 2)
    bad = save(tmp_path, 4)
    replace_npz(bad, b"this is not a zip file " * 100)
    assert "not a readable zip archive" in checkpoint.inspect(bad)
    assert checkpoint.find_latest(str(tmp_path)) == good
    _, manifest = checkpoint.load(str(tmp_path))
    assert manifest["step"] == 2
    valid, invalid = checkpoint.scan(str(tmp_path))
    assert valid == [good] and [p for p, _ in invalid] == [bad]


def test_broken_member_header_falls_back_to_the_previous(tmp_path):
    good = save(tmp_path, 2)
    bad = save(tmp_path, 4)
    with open(bad[:-5] + ".npz", "rb") as fh:
        content = bytearray(fh.read())
    assert content[:4] == b"PK\x03\x04"
    content[:4] = b"XX\x03\x04"            # the first member's local header
    replace_npz(bad, bytes(content))
    assert "broken local header" in checkpoint.inspect(bad)
    assert checkpoint.find_latest(str(tmp_path)) == good
    with pytest.raises(CheckpointError, match="broken local header"):
        checkpoint.load(bad)


@pytest.mark.parametrize("members,problem", [
    ({"notes.txt": b"hello"}, "is not a .npy array"),
    ({"param/wte.npy": b"\x93NUMPY\x03\x00" + b"\0" * 20}, "is .npy version 3.0"),
    ({"param/wte.npy": b"garbage header" * 10}, "cannot be read"),
    ({"param/s.npy": npy_header((2,), descr="<U4") + b"\0" * 32}, "holds dtype <U4, expected a plain numeric"),
])
def test_bad_members_are_found_by_inspect(tmp_path, members, problem):
    path = save(tmp_path, 2)
    replace_npz(path, zip_of(members))
    assert problem in checkpoint.inspect(path)
    with pytest.raises(CheckpointError, match="cannot be used"):
        checkpoint.load(path)


def test_object_arrays_are_refused_without_unpickling(tmp_path):
    path = save(tmp_path, 2)
    buffer = io.BytesIO()
    np.savez(buffer, **{"param/wte": np.array([object()], dtype=object)})
    replace_npz(path, buffer.getvalue())
    assert "holds dtype object" in checkpoint.inspect(path)


def test_random_damage_is_always_a_checkpoint_error(tmp_path):
    """Bytes flipped, cut or inserted in the npz (its CRC made to match), and manifest
    values replaced by values of every JSON type (its checksum made to match): each
    gives None or a problem from inspect, and load agrees, with a CheckpointError."""
    rng = np.random.default_rng(0)
    path = save(tmp_path, 5)
    with open(path[:-5] + ".npz", "rb") as fh:
        good_npz = fh.read()
    with open(path) as fh:
        good_manifest = json.load(fh)
    values = [None, True, -1, 0, 2**70, 1.5, float("nan"), "x", "12", [], {}, [1, 2], {"a": 1}]
    for trial in range(400):
        with open(path, "w") as fh:
            json.dump(good_manifest, fh)
        if trial % 2:
            damaged = bytearray(good_npz)
            pos = int(rng.integers(len(damaged)))
            if trial % 3 == 0:
                damaged[pos] = int(rng.integers(256))                          # flip a byte
            elif trial % 3 == 1:
                del damaged[pos:pos + int(rng.integers(1, 40))]                # cut some out
            else:
                damaged[pos:pos] = rng.integers(0, 256, 9, dtype=np.uint8).tobytes()   # insert some
            replace_npz(path, bytes(damaged))
        else:
            key = sorted(good_manifest)[int(rng.integers(len(good_manifest)))]
            edit_manifest(path, **{key: values[int(rng.integers(len(values)))]})
        problem = checkpoint.inspect(path)
        try:
            checkpoint.load(path)
            assert problem is None
        except CheckpointError:
            assert problem is not None


# ---- 4: zip bombs cost nothing ---------------------------------------------------------------

def test_compressed_member_is_refused(tmp_path):
    path = save(tmp_path, 2)
    bomb = npz_bytes({"param/wte": np.zeros((4096, 4096), np.float32)}, compressed=True)   # 64 MB in ~65 KB
    assert len(bomb) < 1 << 20
    replace_npz(path, bomb)
    assert "is compressed" in checkpoint.inspect(path)
    tracemalloc.start()
    with pytest.raises(CheckpointError, match="'param/wte.npy' is compressed"):
        checkpoint.load(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20, f"refusing a 64 MB bomb took {peak / 2**20:.0f} MiB"
    with pytest.raises(CheckpointError, match="is compressed"):
        checkpoint.load(path, expected={"param/wte": (4096, 4096)})


def duplicate_central_entry(content: bytes, new_name: bytes):
    """Add a second central directory entry for the first member's data (same offset),
    the trick by which a small zip can expand to many times its size."""
    eocd = content.rindex(b"PK\x05\x06")
    entries, cd_size, cd_offset = struct.unpack("<HII", content[eocd + 10:eocd + 20])
    first = content[cd_offset:]
    name_len, extra_len, comment_len = struct.unpack("<HHH", first[28:34])
    assert len(new_name) == name_len
    entry_len = 46 + name_len + extra_len + comment_len
    entry = first[:46] + new_name + first[46 + name_len:entry_len]
    end = bytearray(content[eocd:])
    struct.pack_into("<HHI", end, 8, entries + 1, entries + 1, cd_size + entry_len)
    return content[:cd_offset + cd_size] + entry + bytes(end)


def test_overlapping_members_are_refused(tmp_path):
    path = save(tmp_path, 2)
    content = npz_bytes({"param/a": np.zeros(1000, np.float32)})
    replace_npz(path, duplicate_central_entry(content, b"param/b.npy"))
    assert "more than fit before the next member" in checkpoint.inspect(path)


# ---- 5: only regular files are opened ---------------------------------------------------------

def test_fifo_manifest_is_invalid_and_never_blocks(tmp_path, no_hang):
    good = save(tmp_path, 3)
    fifo = os.path.join(str(tmp_path), "ckpt_00000009.json")
    os.mkfifo(fifo)
    assert checkpoint.inspect(fifo) == "the manifest is not a regular file (it is a named pipe (FIFO))"
    assert checkpoint.find_latest(str(tmp_path)) == good
    assert checkpoint.scan(str(tmp_path)) == ([good], [(fifo, checkpoint.inspect(fifo))])
    with pytest.raises(CheckpointError, match="not a regular file"):
        checkpoint.load(fifo)
    with pytest.raises(CheckpointError, match="not a regular file"):
        checkpoint.read_manifest(fifo)


def test_fifo_or_device_npz_is_invalid_and_never_blocks(tmp_path, no_hang):
    good = save(tmp_path, 3)
    bad = save(tmp_path, 9)
    os.remove(bad[:-5] + ".npz")
    os.mkfifo(bad[:-5] + ".npz")
    assert checkpoint.inspect(bad) == "the npz is not a regular file (it is a named pipe (FIFO))"
    assert checkpoint.find_latest(str(tmp_path)) == good
    with pytest.raises(CheckpointError, match="not a regular file"):
        checkpoint.load(bad)
    os.remove(bad[:-5] + ".npz")
    os.symlink("/dev/zero", bad[:-5] + ".npz")
    assert checkpoint.inspect(bad) == "the npz is not a regular file (it is a device)"


def test_symlinks_to_regular_files_are_fine(tmp_path):
    path = save(tmp_path / "real", 5)
    os.makedirs(tmp_path / "linked")
    for suffix in (".json", ".npz"):
        os.symlink(path[:-5] + suffix, str(tmp_path / "linked" / "ckpt_00000005") + suffix)
    arrays, manifest = checkpoint.load(str(tmp_path / "linked"))
    assert manifest["step"] == 5 and "param/wte" in arrays


# ---- 6: pruning counts only valid checkpoints ---------------------------------------------------

def corrupt_npz(json_path):
    npz = json_path[:-5] + ".npz"
    with open(npz, "r+b") as fh:
        fh.seek(os.path.getsize(npz) // 2)
        fh.write(b"\xff" * 16)


def steps_on_disk(directory):
    return sorted(int(os.path.basename(p)[5:13]) for p in glob.glob(os.path.join(str(directory), "ckpt_*.json")))


def test_corrupt_checkpoints_do_not_count_toward_keep(tmp_path):
    for step in (1, 2, 3, 4, 5):
        save(tmp_path, step, keep=0)
    corrupt_npz(checkpoint.manifest_path(str(tmp_path), 4))
    corrupt_npz(checkpoint.manifest_path(str(tmp_path), 5))
    checkpoint._verified.clear()            # a resumed run: a new process that verified nothing yet
    save(tmp_path, 6, keep=3)
    assert steps_on_disk(tmp_path) == [2, 3, 4, 5, 6]      # the bad ones stay, but do not count
    valid, invalid = checkpoint.scan(str(tmp_path))
    assert [int(os.path.basename(p)[5:13]) for p in valid] == [2, 3, 6]
    assert [int(os.path.basename(p)[5:13]) for p, _ in invalid] == [4, 5]
    save(tmp_path, 7, keep=3)
    assert steps_on_disk(tmp_path) == [3, 4, 5, 6, 7]


def test_the_checkpoint_just_written_is_always_kept(tmp_path):
    for step in (6, 9):
        save(tmp_path, step)
    save(tmp_path, 4, keep=1)               # resumed from an earlier point: 9 is newer, yet 4 stays
    assert steps_on_disk(tmp_path) == [4, 9]


def test_pruning_does_not_reread_kept_checkpoints(tmp_path, monkeypatch):
    crc_reads = []
    real_crc32 = checkpoint._crc32
    monkeypatch.setattr(checkpoint, "_crc32", lambda fh: crc_reads.append(fh.name) or real_crc32(fh))
    for step in range(1, 9):
        save(tmp_path, step, keep=3)
    assert len(crc_reads) == 8, "one CRC per checkpoint written, none for the ones it wrote before"
    assert steps_on_disk(tmp_path) == [6, 7, 8]
    checkpoint._verified.clear()            # a new process: it verifies each kept checkpoint once
    crc_reads.clear()
    save(tmp_path, 9, keep=3)
    assert len(crc_reads) == 1 + 3
    crc_reads.clear()
    save(tmp_path, 10, keep=3)
    assert len(crc_reads) == 1
    assert steps_on_disk(tmp_path) == [8, 9, 10]


def test_a_changed_file_is_checked_again(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step)
    corrupt_npz(checkpoint.manifest_path(str(tmp_path), 3))
    os.utime(checkpoint.manifest_path(str(tmp_path), 3)[:-5] + ".npz", ns=(1, 1))
    save(tmp_path, 4, keep=2)
    assert steps_on_disk(tmp_path) == [2, 3, 4]


# ---- 7: a full or read-only disk ---------------------------------------------------------------

def temp_files(directory):
    return glob.glob(os.path.join(str(directory), "*.tmp.*"))


def test_enospc_while_writing_the_npz_leaves_nothing_behind(tmp_path, monkeypatch):
    good = save(tmp_path, 1)

    def savez_on_full_disk(fh, **arrays):
        fh.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(np, "savez", savez_on_full_disk)
    with pytest.raises(CheckpointError, match=r"disk full at .* \(\d+ MB free\): the checkpoint for step 2 was not "
                                              r"written; the previous checkpoints are intact. Free space or point "
                                              r"--out elsewhere, then --resume auto"):
        save(tmp_path, 2)
    assert temp_files(tmp_path) == []
    assert steps_on_disk(tmp_path) == [1] and not os.path.exists(tmp_path / "ckpt_00000002.npz")
    assert checkpoint.find_latest(str(tmp_path)) == good


def test_enospc_while_writing_the_manifest_leaves_no_npz(tmp_path, monkeypatch):
    good = save(tmp_path, 1)
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 2:                 # the npz's temp file is fsynced first, then the manifest's
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(CheckpointError, match="disk full"):
        save(tmp_path, 2)
    assert temp_files(tmp_path) == [] and not os.path.exists(tmp_path / "ckpt_00000002.npz")
    assert checkpoint.find_latest(str(tmp_path)) == good


def test_failed_manifest_rename_removes_the_new_npz(tmp_path, monkeypatch):
    save(tmp_path, 1)
    real_replace = os.replace

    def replace(src, dst):
        if dst.endswith(".json"):
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(CheckpointError, match=r"cannot write to .* \(Input/output error\): the checkpoint for step 2"):
        save(tmp_path, 2)
    assert temp_files(tmp_path) == [] and not os.path.exists(tmp_path / "ckpt_00000002.npz")


def test_a_failed_temp_write_removes_its_temp_file(tmp_path):
    def fail(fh):
        fh.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError):
        checkpoint._write_temp(str(tmp_path / "ckpt_00000001.npz"), fail)
    assert os.listdir(tmp_path) == []


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs of our own (needs root and permission to mount)."""
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount_point)],
                          check=False, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_real_full_disk_is_a_clear_error_and_frees_the_space(tmpfs):
    directory = tmpfs / "checkpoints"
    good = save(directory, 1, arrays={"param/w": np.ones(10_000, np.float32)})         # 40 KB
    free_before = shutil.disk_usage(str(tmpfs)).free
    with pytest.raises(CheckpointError, match="disk full at .* the checkpoint for step 2 was not written"):
        save(directory, 2, arrays={"param/w": np.ones(1_000_000, np.float32)})     # 4 MB
    assert temp_files(directory) == []
    assert shutil.disk_usage(str(tmpfs)).free == free_before, "the partial temp file must not keep the disk full"
    assert checkpoint.find_latest(str(directory)) == good
    save(directory, 3, arrays={"param/w": np.ones(10_000, np.float32)})               # a retry that fits works
    assert steps_on_disk(directory) == [1, 3]


def test_read_only_folder_is_a_clear_error(tmpfs):
    directory = tmpfs / "checkpoints"
    good = save(directory, 1)
    done = subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs read-only: {done.stderr.strip()}")
    try:
        with pytest.raises(CheckpointError, match=r"cannot write to .* \(read-only filesystem\): the checkpoint for "
                                                  "step 2 was not written; the previous checkpoints are intact"):
            save(directory, 2)
        assert checkpoint.find_latest(str(directory)) == good
        assert checkpoint.load(good)[1]["step"] == 1
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=False)


def test_remove_stale_temp_files(tmp_path):
    assert checkpoint.remove_stale_temp_files(str(tmp_path / "absent")) == []
    save(tmp_path, 3)
    stale = [tmp_path / "ckpt_00000003.npz.tmp.1234", tmp_path / "ckpt_00000004.json.tmp.99"]
    others = [tmp_path / "notes.tmp.1", tmp_path / "ckpt_00000004.npz.tmp.x", tmp_path / "ckpt_3.npz.tmp.1"]
    for path in stale + others:
        path.write_bytes(b"partial")
    removed = checkpoint.remove_stale_temp_files(str(tmp_path))
    assert sorted(removed) == sorted(str(p) for p in stale)
    assert all(not p.exists() for p in stale) and all(p.exists() for p in others)
    assert checkpoint.find_latest(str(tmp_path)).endswith("ckpt_00000003.json")


# ---- 8: never a non-finite checkpoint ----------------------------------------------------------

@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_parameters_are_never_written(tmp_path, bad):
    save(tmp_path, 1)
    before = sorted(os.listdir(tmp_path))
    arrays = make_arrays()
    arrays["param/h.0.attn.qkv.w"][1, 2] = bad
    with pytest.raises(CheckpointError, match=r"param/h.0.attn.qkv.w holds NaN or inf.*Nothing was written"):
        save(tmp_path, 2, arrays=arrays)
    assert sorted(os.listdir(tmp_path)) == before


def test_bad_meta_or_arrays_are_refused_before_writing(tmp_path):
    with pytest.raises(CheckpointError, match=r"lacks the key\(s\) opt_step_count"):
        checkpoint.save(str(tmp_path), 1, make_arrays(), {k: v for k, v in make_meta().items()
                                                          if k != "opt_step_count"})
    with pytest.raises(CheckpointError, match="dtype object"):
        checkpoint.save(str(tmp_path), 1, {"param/w": np.array([None], dtype=object)}, make_meta())
    assert os.listdir(tmp_path) == []
