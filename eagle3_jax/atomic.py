"""Atomic writes: every output of the project is either its old content or the whole new
one, never a part of it, whatever fails or is killed on the way.

- :func:`write_atomic` writes a file: the content (text, bytes, or a callback writing a
  binary file) goes to a fresh temporary file beside ``path`` (``.NAME.tmp-PID-RANDOM``:
  the same directory, so the final rename never crosses file systems, and no two writers
  share it), is flushed and fsynced, and is renamed over ``path`` (``os.replace``).  On
  any failure, ``KeyboardInterrupt`` included, the temporary file is removed and ``path``
  is untouched.
- :func:`write_directory` does the same for a directory: ``fill(tmp)`` writes into a fresh
  directory beside ``path`` (``.NAME.tmp-PID-RANDOM``), every file in it and the directory
  are fsynced, and it is swapped in whole (one ``renameat2(RENAME_EXCHANGE)`` on Linux;
  elsewhere rename aside, rename in, restore on failure).  A writer killed mid-swap may
  leave the previous version beside ``path`` (``.NAME.old-PID-RANDOM``): the next
  :func:`write_directory` into ``path`` first puts it back or removes it
  (:func:`recover`).
- :func:`check_output_path` checks, before any long work, that an output can be written.

Missing parent directories are created.  New files get the mode a plain ``open`` gives
(``0o666`` less the umask); a replaced directory keeps its mode.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: str | os.PathLike, content: str | bytes | Callable[[BinaryIO], object]) -> Path:
    """Writes ``content`` to the file ``path`` atomically (see the module's docstring):
    a ``str`` as UTF-8 text, ``bytes`` as they are, or a callable, called with the
    temporary file opened for binary writing (``lambda f: np.savez(f, **arrays)``).
    Returns ``path`` as a ``Path``."""
    path = Path(path)
    if not (isinstance(content, (str, bytes)) or callable(content)):
        raise TypeError(f"{path}: content must be str, bytes or a callable writing a binary file, "
                        f"got {type(content).__name__}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = sibling(path, "tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with open(fd, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode("utf-8") if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def save_figure(fig, path: str | os.PathLike, **kw) -> Path:
    """Saves the matplotlib figure ``fig`` to ``path`` atomically (the format from its suffix):
    ``path`` is its old content or the whole new figure, never a part of it."""
    fmt = Path(path).suffix.lower().lstrip(".") or None
    return write_atomic(path, lambda f: fig.savefig(f, format=fmt, **kw))


def write_report(path: Path, text: str, flag: str):
    """Writes a finished run's report ``text`` to ``path`` atomically; where that fails, the
    report is printed on stdout and ``OSError`` names ``flag`` (nothing finished is lost)."""
    try:
        write_atomic(path, text)
    except OSError as e:
        print(text, flush=True)
        raise OSError(f"{flag} {path}: cannot write it ({e.strerror or e}); the report is on stdout instead") from None


def write_report_figure(path: Path, draw, report_path: Path):
    """``draw()`` writes the figure ``path`` (atomically); where that fails, ``OSError`` names
    ``--figure`` and says that the report is kept in ``report_path``."""
    try:
        draw()
    except OSError as e:
        raise OSError(f"--figure {path}: cannot write it ({e.strerror or e}); the report is in {report_path}") from None


def write_directory(path: str | os.PathLike, fill: Callable[[Path], object]) -> Path:
    """Replaces the directory ``path`` whole and atomically with what ``fill(tmp)`` writes
    into a fresh directory ``tmp`` beside it (see the module's docstring).  On any failure
    the temporary directory is removed, ``path`` keeps its previous contents, and the error
    is raised as it came.  Returns ``path`` as a ``Path``."""
    path = Path(path)
    tmp = sibling(path, "tmp")
    try:
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True)
        recover(path)
        tmp.mkdir()
        fill(tmp)
        for f in tmp.iterdir():
            fsync(f)
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        fsync(tmp)
        swap_in(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def sibling(path: Path, kind: str) -> Path:
    """A fresh name beside ``path``: ``.NAME.KIND-PID-RANDOM``."""
    return path.parent / f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def fsync(path: Path):
    """Flushes the file or directory ``path`` to disk (a directory only where it can be opened: POSIX)."""
    if path.is_dir() and os.name != "posix":
        return  # directories cannot be opened for fsync there
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap_in(tmp: Path, path: Path):
    """Puts the directory ``tmp`` at ``path`` in one step; the old ``path`` is then deleted."""
    if not path.exists():
        os.rename(tmp, path)
        old = None
    elif exchange(tmp, path):
        old = tmp
    else:
        old = sibling(path, "old")
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)
            raise
    try:  # best effort: the new directory is in place
        fsync(path.parent)
    except OSError:
        pass
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two directories (Linux ``renameat2(RENAME_EXCHANGE)``); False where
    the platform or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def recover(path: Path):
    """Cleans up after writers into ``path`` that were killed: puts a previous version that
    was moved aside back if ``path`` is missing, and removes their temporary files and
    directories (those of live processes are left alone)."""
    mine = re.compile(rf"\.{re.escape(path.name)}\.(tmp|old)-(\d+)-[0-9a-f]+")
    found = sorted((m.group(1) == "tmp", p) for p in path.parent.iterdir()
                   if (m := mine.fullmatch(p.name)) and not _alive(int(m.group(2))))
    for _, p in found:  # "old" first
        if p.name.startswith(f".{path.name}.old-") and not path.exists():
            os.rename(p, path)
        else:
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:  # this process counts: another thread may be writing
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def check_output_path(path, name: str, *, directory: bool = False) -> Path:
    """Checks, before any long work, that ``path`` (a file, or with ``directory`` a
    directory) can be written: an existing one must be of that kind and writable, else its
    nearest existing parent must be a writable directory (missing parents are created when
    the output is written).  Raises ``NotADirectoryError`` / ``IsADirectoryError`` /
    ``PermissionError`` naming ``name`` and the path."""
    path = Path(path)
    if path.exists():
        if directory and not path.is_dir():
            raise NotADirectoryError(f"{name} {path}: exists and is not a directory")
        if not directory and path.is_dir():
            raise IsADirectoryError(f"{name} {path}: is a directory, expected a file path")
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{name} {path}: not writable")
        return path
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"{name} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{name} {path}: cannot create it in {parent} (not writable)")
    return path
