"""Atomic, complete exports: ``save_drafter`` / ``save_target`` replace the directory whole.

A failure injected at every step of the writer (a full disk: ``ENOSPC``; an interrupt),
a real ``SIGKILL`` of a writer at every step, and a real full disk (a small private
tmpfs, where ``unshare`` allows one) each leave the previous export byte-for-byte in
place, loadable, with no temporary directory left once the next save has cleaned up.
The same for one file (``eagle3_jax.atomic.write_atomic``, which every report and data
writer uses) and for any directory (``eagle3_jax.atomic.write_directory``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy

import eagle3_jax
from eagle3_jax import atomic
from helpers import tiny_drafter, tiny_target


def snapshot(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def leftovers(path: pathlib.Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Two exports of different drafters: A (the previous good one) and B (the new one)."""
    root = tmp_path_factory.mktemp("versions")
    a, b = tiny_drafter(1), tiny_drafter(2)
    eagle3_jax.save_drafter(a, root / "A")
    eagle3_jax.save_drafter(b, root / "B")
    assert snapshot(root / "A") != snapshot(root / "B")
    return root / "A", root / "B", b, np.asarray(a.embed[...])


# ----------------------------------------------------------------- layout and modes
def test_stale_files_of_another_layout_cannot_shadow_the_new_export(tmp_path):
    old, new = tiny_target(0), tiny_target(1)
    path = tmp_path / "t"
    eagle3_jax.save_target(old, path)
    # make the old export look like a sharded checkpoint plus a torch file (what load_target prefers)
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: "model-00001-of-00001.safetensors" for k in index["weight_map"]}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "pytorch_model.bin").write_bytes(b"stale")
    assert np.array_equal(eagle3_jax.load_target(path).wq[...], old.wq[...])

    eagle3_jax.save_target(new, path)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors", "model.safetensors.index.json"]
    back = eagle3_jax.load_target(path)
    for name in ("embed", "wq", "w_down", "norm", "lm_head"):
        np.testing.assert_array_equal(np.asarray(getattr(back, name)[...]), np.asarray(getattr(new, name)[...]))
    assert leftovers(path) == []


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=oct)
def test_file_modes_follow_the_umask_and_a_replaced_directory_keeps_its_mode(tmp_path, umask):
    drafter = tiny_drafter(0)
    previous = os.umask(umask)
    try:
        eagle3_jax.save_drafter(drafter, tmp_path / "d")
        modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "d").iterdir()}
        assert modes == {"config.json": 0o666 & ~umask, "model.safetensors": 0o666 & ~umask}
        assert (tmp_path / "d").stat().st_mode & 0o777 == 0o777 & ~umask
        os.chmod(tmp_path / "d", 0o750)
        eagle3_jax.save_drafter(drafter, tmp_path / "d")
        assert (tmp_path / "d").stat().st_mode & 0o777 == 0o750
    finally:
        os.umask(previous)


def test_a_symlinked_export_directory_is_replaced_behind_the_link(tmp_path, versions):
    a, b, drafter_b, _ = versions
    shutil.copytree(a, tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    eagle3_jax.save_drafter(drafter_b, tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and snapshot(tmp_path / "real") == snapshot(b)


# ----------------------------------------------------------------- injected faults
_PRIMITIVES = [(os, "mkdir"), (os, "chmod"), (os, "fsync"), (os, "rename"), (pathlib.Path, "write_text"),
               (safetensors.numpy, "save_file"), (atomic, "exchange")]


@contextlib.contextmanager
def fault_at(n: int, make_error, exchange: bool):
    """Makes the ``n``-th call into the writer's file-system primitives raise ``make_error(name)``."""
    calls = [0]
    saved = [(owner, name, getattr(owner, name)) for owner, name in _PRIMITIVES]

    def wrap(name, fn):
        def wrapped(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                raise make_error(name)
            return fn(*args, **kwargs)
        return wrapped

    try:
        for owner, name, fn in saved:
            setattr(owner, name, wrap(name, fn if exchange or name != "exchange" else lambda a, b: False))
        yield calls
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def disk_full(name):
    if name == "save_file":  # what safetensors raises on a real full disk
        return safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
@pytest.mark.parametrize("fault", ["disk-full", "interrupt"])
def test_a_failure_at_any_step_leaves_the_previous_export(tmp_path, versions, exchange, fault):
    a, b, drafter_b, embed = versions
    failed = 0  # failures that left the previous export
    for n in range(1, 100):
        path = tmp_path / str(n) / "export"
        shutil.copytree(a, path)
        make_error = disk_full if fault == "disk-full" else (lambda name: KeyboardInterrupt())
        try:
            with fault_at(n, make_error, exchange):
                eagle3_jax.save_drafter(drafter_b, path)
        except (OSError, KeyboardInterrupt) as e:
            assert leftovers(path) == [], f"step {n}"
            if fault == "disk-full":  # an OSError once the new export is in place is not raised
                assert isinstance(e, OSError) and e.errno == errno.ENOSPC and str(path) in str(e)
            elif snapshot(path) == snapshot(b):
                continue  # interrupted once the new export was in place: it stays, whole
            assert snapshot(path) == snapshot(a), f"step {n}"
            failed += 1
            continue
        # the fault came after the new export was in place (or past the last step): never half
        assert snapshot(path) == snapshot(b), f"step {n}"
        assert leftovers(path) == [], f"step {n}"
        if n > 40:
            break
    assert failed >= 7  # mkdir, save_file, write_text, chmod ×2, fsync ×3, swap ...
    back = eagle3_jax.load_drafter(tmp_path / "1" / "export", embed=embed)
    np.testing.assert_array_equal(np.asarray(back.fc[...]), np.asarray(tiny_drafter(1).fc[...]))


# ----------------------------------------------------------------- real kills
_KILLER = r"""
import json, os, pathlib, shutil, signal, sys
import safetensors.numpy
from eagle3_jax import atomic
from eagle3_jax.checkpoint.save import write_checkpoint

work, pristine, new, exchange = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]), sys.argv[4] == "1"
tensors = safetensors.numpy.load_file(str(new / "model.safetensors"))
config = json.loads((new / "config.json").read_text())
killed = []
for n in range(1, 100):
    path = work / str(n) / "export"
    shutil.copytree(pristine, path)
    pid = os.fork()
    if pid == 0:  # the writer: SIGKILLed on entering its n-th file-system call
        calls = [0]
        def hook(fn):
            def wrapped(*args, **kwargs):
                calls[0] += 1
                if calls[0] == n:
                    os.kill(os.getpid(), signal.SIGKILL)
                return fn(*args, **kwargs)
            return wrapped
        for owner, name in [(os, "mkdir"), (os, "chmod"), (os, "fsync"), (os, "rename"), (shutil, "rmtree"),
                            (pathlib.Path, "write_text"), (safetensors.numpy, "save_file")]:
            setattr(owner, name, hook(getattr(owner, name)))
        atomic.exchange = hook(atomic.exchange) if exchange else (lambda a, b: False)
        write_checkpoint(path, tensors, {"config.json": config})
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status):
        assert os.WEXITSTATUS(status) == 0
        break
    assert os.WTERMSIG(status) == signal.SIGKILL
    killed.append(n)
print(json.dumps(killed))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_a_writer_killed_at_any_step_leaves_the_previous_export(tmp_path, versions, exchange):
    a, b, _, embed = versions
    out = subprocess.run([sys.executable, "-c", _KILLER, str(tmp_path), str(a), str(b), str(int(exchange))],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    killed = json.loads(out.stdout.strip().splitlines()[-1])
    assert killed == list(range(1, len(killed) + 1)) and len(killed) >= 8
    for n in killed:
        path = tmp_path / str(n) / "export"
        if path.exists():
            assert snapshot(path) in (snapshot(a), snapshot(b)), f"killed at step {n}"
        else:  # killed between "rename aside" and "rename in": the old version waits beside it
            assert not exchange
            aside = [p for p in path.parent.iterdir() if p.name.startswith(".export.old-")]
            assert len(aside) == 1 and snapshot(aside[0]) == snapshot(a)
        atomic.recover(path)  # what the next save into path does first
        assert snapshot(path) in (snapshot(a), snapshot(b)) and leftovers(path) == [], f"killed at step {n}"
    assert snapshot(tmp_path / "1" / "export") == snapshot(a)
    eagle3_jax.load_drafter(tmp_path / "1" / "export", embed=embed)
    done = tmp_path / str(len(killed) + 1) / "export"
    assert snapshot(done) == snapshot(b) and leftovers(done) == []


# ----------------------------------------------------------------- a real full disk
_FULL_DISK = r"""
import json, pathlib, shutil, sys
import numpy as np
import eagle3_jax

disk, pristine, new, embed = (pathlib.Path(p) for p in sys.argv[1:5])
path = disk / "export"
shutil.copytree(pristine, path)
before = {p.name: p.read_bytes() for p in path.iterdir()}
result = {}
try:
    eagle3_jax.save_drafter(eagle3_jax.load_drafter(new, embed=np.load(embed)), path)
except OSError as e:
    result["error"] = [type(e).__name__, e.errno, str(e)]
result["intact"] = {p.name: p.read_bytes() for p in path.iterdir()} == before
result["entries"] = sorted(p.name for p in disk.iterdir())
eagle3_jax.load_drafter(path, embed=np.load(embed))
result["loads"] = True
print(json.dumps(result))
"""


@pytest.mark.skipif(shutil.which("unshare") is None or not sys.platform.startswith("linux"), reason="needs unshare")
def test_a_full_disk_leaves_the_previous_export(tmp_path):
    """A real ENOSPC: a tmpfs (in a private mount namespace) with room for one export, not two."""
    a = tiny_drafter(1, hidden=64, target_hidden=64)
    b = tiny_drafter(2, hidden=64, target_hidden=64)
    eagle3_jax.save_drafter(a, tmp_path / "A")
    eagle3_jax.save_drafter(b, tmp_path / "B")
    np.save(tmp_path / "embed.npy", np.asarray(a.embed[...]))
    size = sum(p.stat().st_size for p in (tmp_path / "A").iterdir())
    disk = tmp_path / "disk"
    disk.mkdir()
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    script = (f"mount -t tmpfs -o size={size * 3 // 2 // 1024}k tmpfs {disk} || exit 77; "
              f'exec "{sys.executable}" -c "$0" "$@"')
    out = subprocess.run([*unshare, "sh", "-c", script, _FULL_DISK, str(disk), str(tmp_path / "A"),
                          str(tmp_path / "B"), str(tmp_path / "embed.npy")], capture_output=True, text=True, timeout=120)
    if out.returncode == 77 or "unshare failed" in out.stderr or "Operation not permitted" in out.stderr:
        pytest.skip(f"no private tmpfs here: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    name, code, message = result["error"]
    assert code == errno.ENOSPC and str(disk / "export") in message
    assert result["intact"] and result["loads"] and result["entries"] == ["export"]


# ----------------------------------------------------------------- one file: write_atomic
@pytest.mark.parametrize("content", ["text ✓\n", b"\x00bytes", lambda f: f.write(b"from a callback")],
                         ids=["str", "bytes", "callback"])
def test_write_atomic_writes_text_bytes_or_a_callback_and_creates_parents(tmp_path, content):
    path = tmp_path / "a" / "b" / "out.txt"
    assert atomic.write_atomic(str(path), content) == path
    expected = content.encode() if isinstance(content, str) else content if isinstance(content, bytes) \
        else b"from a callback"
    assert path.read_bytes() == expected and os.listdir(path.parent) == ["out.txt"]


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=oct)
def test_write_atomic_gives_the_mode_open_gives(tmp_path, umask):
    previous = os.umask(umask)
    try:
        atomic.write_atomic(tmp_path / "f", "x")
    finally:
        os.umask(previous)
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("where", ["open", "write", "fsync", "replace"])
@pytest.mark.parametrize("fault", ["disk-full", "interrupt"])
def test_write_atomic_failing_at_any_step_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, where, fault):
    path = tmp_path / "report.json"
    path.write_text("old")
    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if fault == "disk-full" else KeyboardInterrupt()

    def fail(*args, **kwargs):
        raise error

    if where == "write":
        content = fail
    else:
        content = "new"
        monkeypatch.setattr(os, {"open": "open", "fsync": "fsync", "replace": "replace"}[where], fail)
    with pytest.raises(type(error)):
        atomic.write_atomic(path, content)
    monkeypatch.undo()
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["report.json"]


def test_write_atomic_refuses_other_content_before_touching_anything(tmp_path):
    with pytest.raises(TypeError, match=r"out\.json: content must be str, bytes or a callable"):
        atomic.write_atomic(tmp_path / "new" / "out.json", {"not": "serialised"})
    assert os.listdir(tmp_path) == []


def test_the_project_writers_share_one_atomic_writer():
    from eagle3_jax import experiment
    from eagle3_jax.train import data

    assert experiment.write_atomic is data.write_atomic is atomic.write_atomic


# ----------------------------------------------------------------- one directory: write_directory
def test_write_directory_failing_in_fill_leaves_the_old_directory(tmp_path):
    path = tmp_path / "d"
    path.mkdir()
    (path / "keep").write_text("old")

    def fill(tmp):
        (tmp / "half").write_text("new")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError):
        atomic.write_directory(path, fill)
    assert snapshot(path) == {"keep": b"old"} and leftovers(path) == []
    atomic.write_directory(path, lambda tmp: (tmp / "new").write_text("whole"))
    assert snapshot(path) == {"new": b"whole"} and leftovers(path) == []
