"""The store directory on disk: its file names, their modes, and who may open them.

Owns the layout of a store directory, the modes of everything the store creates in it, the
checks made before any file in it is opened (no symbolic links, an owner that is the caller
unless allowed otherwise), and the advisory lock that tells a running store from an index
rebuild. It must never read or write records or the index's contents.

Where: the store directory is created if missing, but its parent must exist unless the caller
asks for creation (``create=True``): a mistyped mount point must not fill the root disk. A
directory this process cannot write (read-only file system, permissions, immutable) is refused
before any file is opened, naming the directory.

Modes: files 0600 and directories 0700, or 0660 / 0770 with ``shared_group=True`` for a
group of users sharing one store. Modes are set with ``fchmod`` after creation, so the umask
can neither widen nor narrow them.

Symbolic links: segment files are opened with ``O_NOFOLLOW`` relative to a descriptor of
``segments/`` that was itself opened with ``O_NOFOLLOW``, so a planted link is refused, not
followed. SQLite cannot be told not to follow links from Python, so ``index.sqlite3`` and its
``-wal`` / ``-shm`` files are checked with ``lstat`` just before SQLite opens them; the window
between the check and the open is left to the directory's own mode (0700 by default: only
its owner can plant anything).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from dataclasses import dataclass

from kvtier.tiers.remote.errors import StoreBusy, StoreLocationError, StoreUnsafe

INDEX_FILENAME = "index.sqlite3"
INDEX_SIDE_FILES = ("-wal", "-shm")
SEGMENTS_DIRNAME = "segments"


@dataclass(frozen=True)
class Modes:
    """Permission bits of what the store creates."""

    file: int
    directory: int

    @classmethod
    def for_store(cls, shared_group: bool) -> "Modes":
        return cls(0o660, 0o770) if shared_group else cls(0o600, 0o700)


def segment_name(seg: int) -> str:
    return f"{seg:08d}.seg"


def refuse_symlink(path: str) -> None:
    """Raise StoreUnsafe if ``path`` exists as a symbolic link."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise StoreUnsafe(
            f"{path} is a symbolic link (to {os.readlink(path)!r}); a kvtier store never "
            "follows links inside its directory: remove the link"
        )


def _make_directory(path: str, mode: int) -> None:
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return
    os.chmod(path, mode, follow_symlinks=False)


def _nearest_existing(path: str) -> str:
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def _create_directory(path: str, modes: Modes, create: bool) -> None:
    """Create the store directory; its parents too only when ``create``."""
    parent = os.path.dirname(path)
    existing = _nearest_existing(parent)
    if not os.path.isdir(existing):
        raise StoreLocationError(
            errno.ENOTDIR,
            f"store directory {path}: {existing} is a file, not a directory; give the store a path "
            "inside a directory (remote=/path/to/dir)",
        )
    if existing != parent and not create:
        raise StoreLocationError(
            errno.ENOENT,
            f"store directory {path}: its parent {parent} does not exist ({existing} is the nearest "
            "that does); check the path (a mistyped mount point would fill the disk below it), or "
            "pass create=True (config key remote_create = true) to create the missing directories",
        )
    try:
        os.makedirs(parent, exist_ok=True)
        _make_directory(path, modes.directory)
    except OSError as exc:
        raise StoreLocationError(exc.errno, f"store directory {path} cannot be created: {_why(exc, existing)}") from exc


def _why(exc: OSError, path: str) -> str:
    """The cause of an OSError at ``path`` in words, with the fix."""
    if exc.errno == errno.EROFS or _read_only(path):
        return f"{path} is on a read-only file system ({_mount_point(path)}); put the store on a writable one"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (
            f"this process (uid {os.geteuid()}) may not write {path} ({exc.strerror}; mode "
            f"{stat.S_IMODE(os.stat(path).st_mode):o}, owner uid {os.stat(path).st_uid}); give it write "
            "permission or pick a directory it owns"
        )
    return f"{exc.strerror} ({path})"


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _mount_point(path: str) -> str:
    """Where the file system holding ``path`` is mounted: the longest mount point above it in
    /proc/self/mounts (bind mounts included), else the nearest ``os.path.ismount``."""
    path = os.path.realpath(path)
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            points = [line.split()[1].encode().decode("unicode_escape") for line in f if line.strip()]
    except OSError:
        points = []
    inside = [p for p in points if path == p or path.startswith(p.rstrip("/") + "/")]
    if inside:
        return f"mounted at {max(inside, key=len)}"
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return f"mounted at {path}"


def open_store_directory(path: str, modes: Modes, allow_foreign_owner: bool, create: bool = False) -> int:
    """Create the store directory if needed and return an ``O_DIRECTORY`` descriptor of it.

    The directory itself may be reached through a link (that is the caller's choice of
    path); its owner must be the caller unless ``allow_foreign_owner``; missing parents are
    created only with ``create``; a directory this process cannot write is refused."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        _create_directory(path, modes, create)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        owner = os.fstat(fd).st_uid
        if owner != os.geteuid() and not allow_foreign_owner:
            raise StoreUnsafe(
                f"store directory {path} belongs to uid {owner}, not to this process (uid "
                f"{os.geteuid()}); open it with allow_foreign_owner=True if that user is trusted"
            )
        if not os.access(path, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
            code = errno.EROFS if _read_only(path) else errno.EACCES
            raise StoreLocationError(
                code, f"store directory {path} is not writable: {_why(OSError(code, os.strerror(code)), path)}"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_segments_directory(store_fd: int, path: str, modes: Modes) -> int:
    """``segments/`` inside the store, created if needed; a link there is refused."""
    try:
        os.mkdir(SEGMENTS_DIRNAME, modes.directory, dir_fd=store_fd)
        os.chmod(SEGMENTS_DIRNAME, modes.directory, dir_fd=store_fd, follow_symlinks=False)
    except FileExistsError:
        pass
    try:
        return os.open(
            SEGMENTS_DIRNAME,
            os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
            dir_fd=store_fd,
        )
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            refuse_symlink(os.path.join(path, SEGMENTS_DIRNAME))
        raise


def open_no_follow(dir_fd: int, name: str, flags: int, path_for_errors: str, mode: int = 0o600) -> int:
    """``os.open`` of ``name`` under ``dir_fd`` that refuses a symbolic link with StoreUnsafe."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreUnsafe(
                f"{path_for_errors} is a symbolic link; a kvtier store never follows links "
                "inside its directory: remove the link"
            ) from exc
        raise


def create_file(dir_fd: int, name: str, path_for_errors: str, modes: Modes) -> int:
    """Create ``name`` exclusively (never through a link) with the store's file mode."""
    fd = open_no_follow(dir_fd, name, os.O_RDWR | os.O_CREAT | os.O_EXCL, path_for_errors, modes.file)
    os.fchmod(fd, modes.file)
    return fd


def prepare_index_files(store_fd: int, directory: str, modes: Modes) -> str:
    """Refuse links at the index's paths and create the index file with the store's mode, so
    SQLite (which gives ``-wal`` and ``-shm`` the mode of the database file) inherits it."""
    path = os.path.join(directory, INDEX_FILENAME)
    for suffix in ("", *INDEX_SIDE_FILES):
        refuse_symlink(path + suffix)
    try:
        os.close(create_file(store_fd, INDEX_FILENAME, path, modes))
    except FileExistsError:
        pass
    return path


def lock_shared(store_fd: int, directory: str) -> None:
    """Held by every open store: a rebuild needs the directory to itself."""
    try:
        fcntl.flock(store_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise StoreBusy(
            f"store {directory} is being rebuilt (another process holds it exclusively); "
            "open it again when `kvtier store rebuild` has finished"
        ) from None


def lock_exclusive(store_fd: int, directory: str) -> None:
    """Taken by a rebuild; fails at once while any process has the store open."""
    try:
        fcntl.flock(store_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise StoreBusy(
            f"store {directory} is open in another process; close every process using it "
            "before rebuilding its index"
        ) from None
