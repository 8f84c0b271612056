"""Opening a file that a request names, inside a folder the operator chose.

A runtime adapter load (``POST /v1/load_lora_adapter``) names its file with
a path from the request body.  Checking that path (``realpath`` inside
``--lora-dir``) and then letting llama.cpp open it again by name leaves a
window in which a symlink swapped in makes llama.cpp read a file outside the
folder.  So the file is opened once, walking down from the folder one
component at a time with ``O_NOFOLLOW`` (no symlink anywhere below the
folder, no ``..``), the open descriptor is checked (a regular file, and
where it really lies is still inside the folder: ``/proc/self/fd/N``), and
llama.cpp reads that very file through ``/proc/self/fd/N``: opening that
link reopens the descriptor's inode, whatever the path names by then.

Where ``/proc/self/fd`` can't be used (not Linux, or no ``/proc`` mounted)
the loader gets the checked path instead, and :meth:`OpenedFile.unchanged`
says whether the same file still lies there after the load; the window is
then narrowed, not closed.  Without ``O_NOFOLLOW`` and ``dir_fd`` (Windows)
the path is checked with ``realpath`` only.
"""
from __future__ import annotations

import errno
import os
import stat
import sys

from llamax.server.errors import APIError

__all__ = ["OpenedFile", "open_inside", "check_path_text"]

_PATH_MAX = 4096    # bytes, Linux's PATH_MAX: longer is refused before any system call
_WALK = os.open in os.supports_dir_fd and hasattr(os, "O_NOFOLLOW") and hasattr(os, "O_DIRECTORY")
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO must not hold the opening thread until a writer comes
_NOCTTY = getattr(os, "O_NOCTTY", 0)


class OpenedFile:
    """A regular file opened inside a folder.

    ``real`` is where it lay when opened (for messages and listings);
    ``path`` is what to hand a loader: ``/proc/self/fd/N`` while the
    descriptor is open (Linux), else ``real``.  Close it after the load, or
    keep it open for as long as the loader may read ``path`` again.
    """

    __slots__ = ("fd", "real", "path", "by_fd", "_id")

    def __init__(self, fd: int, real: str, by_fd: bool):
        self.fd = fd
        self.real = real
        self.by_fd = by_fd
        self.path = f"/proc/self/fd/{fd}" if by_fd else real
        st = os.fstat(fd)
        self._id = (st.st_dev, st.st_ino)

    def unchanged(self) -> bool:
        """Whether ``path`` still names the opened file (always true by
        descriptor; by name, the same device and inode, no symlink)."""
        if self.by_fd:
            return self.fd >= 0
        try:
            st = os.stat(self.real, follow_symlinks=False)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == self._id

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<OpenedFile {self.real!r} fd={self.fd}>"


def check_path_text(p: str, param: str) -> bytes:
    """``p`` as the bytes a system call gets, or a 400 naming ``param``:
    a NUL byte would end the C string early (Python raises ValueError), a
    lone surrogate can't be encoded, and a path over PATH_MAX fails anyway."""
    if "\x00" in p:
        raise APIError(400, f"{param} contains a NUL byte", param=param, code="invalid_path")
    try:
        raw = os.fsencode(p)
    except UnicodeError:
        raise APIError(400, f"{param} can't be encoded as a file name ({sys.getfilesystemencoding()})",
                       param=param, code="invalid_path") from None
    if len(raw) > _PATH_MAX:
        raise APIError(400, f"{param} is longer than {_PATH_MAX} bytes", param=param, code="invalid_path")
    return raw


def _inside(path: str, base: str) -> bool:
    return os.path.commonpath([path, base]) == base


def _components(folder: str, base: str, p: str, param: str) -> list[str]:
    """The components of ``p`` below the folder: ``p`` relative to it, or
    absolute under it (as given or as its real path)."""
    if os.path.isabs(p):
        for prefix in (base, os.path.abspath(folder)):
            head = prefix.rstrip(os.sep) + os.sep
            if p.startswith(head) or p == prefix:
                p = p[len(head):] if p.startswith(head) else ""
                break
        else:
            raise APIError(400, f"{param} must be inside --lora-dir ({folder})", param=param,
                           code="path_not_allowed")
    parts = [c for c in p.split(os.sep) if c not in ("", ".")]
    if os.altsep:
        parts = [c for part in parts for c in part.split(os.altsep) if c not in ("", ".")]
    if ".." in parts:
        raise APIError(400, f"{param} may not contain '..' (it must stay inside --lora-dir, {folder})",
                       param=param, code="path_not_allowed")
    if not parts:
        raise APIError(400, f"{param} names the folder --lora-dir itself, not a file in it", param=param,
                       code="invalid_path")
    return parts


def _refusal(e: OSError, dfd: int, name: str, shown: str, folder: str, param: str) -> APIError:
    """Why opening ``name`` (in the folder open as ``dfd``) failed, as the error to answer."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        st = None
    # ELOOP with O_NOFOLLOW: it was a symlink when opened (it may be a file again by now)
    if e.errno == errno.ELOOP or (st is not None and stat.S_ISLNK(st.st_mode)):
        return APIError(400, f"{shown}: a symbolic link; runtime loads follow none inside --lora-dir "
                        f"({folder})", param=param, code="path_not_allowed")
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return APIError(404, f"no adapter file {shown!r} in --lora-dir", param=param, code="file_not_found")
    if e.errno == errno.ENAMETOOLONG:
        return APIError(400, f"{param}: a name in it is too long", param=param, code="invalid_path")
    if e.errno in (errno.EACCES, errno.EPERM):
        return APIError(400, f"{shown}: permission denied", param=param, code="file_unreadable")
    return APIError(400, f"{shown}: cannot open ({e.strerror or e})", param=param, code="file_unreadable")


def _by_fd_works(fd: int) -> bool:
    """``/proc/self/fd/N`` names this descriptor's file (Linux with /proc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        a, b = os.stat(f"/proc/self/fd/{fd}"), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def open_inside(folder: str, p: str, *, param: str) -> OpenedFile:
    """Open the regular file ``p`` names inside ``folder`` once, or raise
    the APIError to answer (400 outside the folder, through a symlink, not
    a regular file; 404 missing).  The caller closes it.  (A worker thread:
    the file system may be slow.)"""
    check_path_text(p, param)
    base = os.path.realpath(folder)
    if not _WALK:
        return _open_checked_by_name(folder, base, p, param)
    parts = _components(folder, base, p, param)
    try:
        dfd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:   # the operator's folder went away: not the request's fault
        raise APIError(503, f"--lora-dir ({folder}) can't be opened: {e.strerror or e}",
                       code="lora_dir_unavailable") from None
    fd = -1
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | (_NONBLOCK | _NOCTTY if last else os.O_DIRECTORY)
            try:
                nfd = os.open(name, flags, dir_fd=dfd)
            except OSError as e:
                raise _refusal(e, dfd, name, os.path.join(*parts[:i + 1]), folder, param) from None
            if last:
                fd = nfd
            else:
                os.close(dfd)
                dfd = nfd
        shown = os.path.join(*parts)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise APIError(400, f"{shown}: not a regular file", param=param, code="invalid_path")
        if _by_fd_works(fd):
            # where the opened file really lies now: a folder on the way may
            # have been moved out of --lora-dir while we walked down
            real = os.readlink(f"/proc/self/fd/{fd}")
            if real.endswith(" (deleted)"):
                real = real[: -len(" (deleted)")]
            if not _inside(real, base):
                raise APIError(400, f"{shown}: moved out of --lora-dir while it was opened", param=param,
                               code="path_not_allowed")
            f = OpenedFile(fd, real, by_fd=True)
        else:
            f = OpenedFile(fd, os.path.join(base, *parts), by_fd=False)
        fd = -1
        return f
    finally:
        os.close(dfd)
        if fd >= 0:
            os.close(fd)


def _open_checked_by_name(folder: str, base: str, p: str, param: str) -> OpenedFile:
    """No O_NOFOLLOW/dir_fd (Windows): the real path inside the folder, then
    open by name; the race stays (documented in the module docstring)."""
    real = os.path.realpath(p if os.path.isabs(p) else os.path.join(base, p))
    if not _inside(real, base):
        raise APIError(400, f"{param} must be inside --lora-dir ({folder})", param=param, code="path_not_allowed")
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise APIError(404, f"no adapter file {p!r} in --lora-dir", param=param, code="file_not_found") from None
    except OSError as e:
        raise APIError(400, f"{p}: cannot open ({e.strerror or e})", param=param, code="file_unreadable") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise APIError(400, f"{p}: not a regular file", param=param, code="invalid_path")
    return OpenedFile(fd, real, by_fd=False)
