"""The files of a checkpoint folder: private, verified, and loaded without ever running code.

`posttrain.core.checkpoint` lays out the folders; this module owns what happens to each file.

Private: files are created with mode 0600 and folders with 0700, exactly, whatever the umask
(or the modes of a team setting: `posttrain.core.run_permissions`).

Verified: `write_manifest` records the size and sha256 of every file of a checkpoint in
`manifest.json`, written last; `verify_manifest` checks them again (size first, so a truncated or
empty file is named without hashing it) and raises `CheckpointCorruptError` naming the checkpoint
and the file. sha256 runs at about 1.5 GB/s on one core; the manifest is a checksum against disk
faults, not a signature: whoever can rewrite the files can rewrite it too.

Full disk: a write the file system refuses for want of space (errno ENOSPC or EDQUOT, or torch's
"enforce fail at inline_container.cc" RuntimeError that wraps it, sometimes without the errno)
is raised again as `OSError(errno.ENOSPC)` whose message names the folder, the bytes the write
needed and the bytes free (`is_disk_full`, `no_space_error`); the partial file is removed.

Never runs code: `read_weights_only` loads with `torch.load(weights_only=True)` only (tensors,
numbers, strings, lists, tuples, dicts, dtypes). A file whose unpickling would need any other
object (a class or a function, which could execute anything) is refused with
`UnsafeCheckpointError` before it is unpickled. `check_weights_only` makes the same check when a
checkpoint is saved, so a checkpoint that could not be loaded is never written.

torch is imported by the functions that handle tensors, on first use: the run-folder files
(`write_text_atomic`, the lock in `posttrain.core.run_lock`) are read and written without it, so
`posttrain runs` lists runs without loading torch.

Example:
    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     write_torch({"w": torch.ones(2)}, Path(folder) / "model.pt")
    ...     write_manifest(Path(folder), ["model.pt"])
    ...     sorted(verify_manifest(Path(folder), required=["model.pt"]))
    ['model.pt']
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import IO, Any

from posttrain.core.run_permissions import run_modes

__all__ = [
    "MANIFEST_FILE",
    "FILE_MODE",
    "DIR_MODE",
    "CheckpointCorruptError",
    "UnsafeCheckpointError",
    "make_private_dir",
    "write_bytes",
    "write_text_atomic",
    "write_torch",
    "sha256_file",
    "write_manifest",
    "verify_manifest",
    "check_weights_only",
    "read_weights_only",
    "is_disk_full",
    "free_bytes",
    "no_space_error",
    "state_bytes",
]

MANIFEST_FILE = "manifest.json"
"""Size and sha256 of every other file of a checkpoint folder; written last."""

FILE_MODE, DIR_MODE = 0o600, 0o700
"""Modes of checkpoint files and folders: readable by their owner only."""

_CHUNK = 1 << 20


class CheckpointCorruptError(ValueError):
    """A checkpoint cannot be trusted: a file differs from its manifest (bit flip, truncation,
    empty or missing file), or the manifest itself is missing or unreadable."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds objects that only full unpickling could rebuild, which can run
    arbitrary code; posttrain refuses to unpickle it."""


# --------------------------------------------------------------------------------------------
# Private files and folders
# --------------------------------------------------------------------------------------------


def make_private_dir(path: Path) -> bool:
    """Create folder `path` with mode 0700 (or `run_permissions`' folder mode; missing parents
    with the usual mode) and return True; if it already exists, change nothing, return False."""
    dir_mode = run_modes()[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, dir_mode & 0o777)
    except FileExistsError:
        return False
    os.chmod(path, dir_mode)  # exactly, whatever the umask
    return True


def write_bytes(data: bytes, path: Path) -> None:
    """Write `data` to `path` as a file of mode 0600, fsync'ed."""
    _write_private(path, lambda f: f.write(data))


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) to `path` as a 0600 file that is either whole or absent: written to
    a temporary file in the same folder, fsync'ed, then renamed over `path`. A reader (a resumed
    run) never sees half of it; a failed write leaves `path` as it was and no temporary file.

    Raises:
        OSError: errno ENOSPC naming the folder, the bytes needed and free, if the file system
            is full (`no_space_error`); any other OSError of the write as it is.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = text.encode("utf-8")
    try:
        write_bytes(data, tmp)
        os.replace(tmp, path)
    except BaseException as e:
        full = is_disk_full(e, path.parent, len(data))
        tmp.unlink(missing_ok=True)
        if full:
            raise no_space_error(path.parent, len(data), path.name) from e
        raise


def write_torch(obj: Any, path: Path) -> None:
    """`torch.save(obj)` to `path` as a file of mode 0600, fsync'ed."""
    import torch

    _write_private(path, lambda f: torch.save(obj, f))


def _write_private(path: Path, fill: Callable[[IO[bytes]], Any]) -> None:
    file_mode = run_modes()[0]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, file_mode)
    try:
        os.fchmod(fd, file_mode)  # an existing file keeps its mode through O_CREAT
        f = os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        fill(f)
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------------------------
# Full disk
# --------------------------------------------------------------------------------------------

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_TORCH_WRITE_FAILURES = ("inline_container", "iostream error")
"""Words of the RuntimeError torch raises when its C++ zip writer fails to write."""


def is_disk_full(exc: BaseException, folder: Path, needed: int) -> bool:
    """Whether `exc`, raised while writing `needed` bytes into `folder`, means the file system
    is full: an OSError with errno ENOSPC or EDQUOT anywhere in its chain (cause, context, the
    per-rank failures of a torch.distributed.checkpoint CheckpointException), or torch's
    zip-writer RuntimeError (which may have lost the errno) while `folder`'s file system has
    fewer than `needed` bytes free. Call it before removing the partial write."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    torch_write_failed = False
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        if isinstance(e, RuntimeError) and any(w in str(e) for w in _TORCH_WRITE_FAILURES):
            torch_write_failed = True
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exc, trace)}
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        stack += [e.__cause__, e.__context__]
    return torch_write_failed and (free_bytes(folder) < needed or free_files(folder) == 0)


def free_bytes(folder: Path) -> int:
    """Bytes free to this user on the file system of `folder` (or of its nearest existing
    parent)."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def free_files(folder: Path) -> int | None:
    """Files (inodes) this user may still create on the file system of `folder` (or of its
    nearest existing parent); None where it does not count them (btrfs reports 0 of 0)."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    stats = os.statvfs(folder)
    return stats.f_favail if stats.f_files else None


def no_space_error(
    folder: Path, needed: int, what: str, *, estimate: bool = False, note: str = ""
) -> OSError:
    """`OSError(errno.ENOSPC)` for a write of `what` (`needed` bytes, "about" if `estimate`)
    into `folder` that the full file system refused:

        [Errno 28] no space left on device: writing checkpoint step_000002 (about 4,000,512
        bytes, 3.8 MiB) into /runs/a/checkpoints; 1,048,576 bytes (1.0 MiB) are free there
        {note}. Free space on that file system or write elsewhere, then run again

    Free bytes are measured now: call it after removing the partial write.
    """
    free = free_bytes(folder)
    size = f"{'about ' if estimate else ''}{needed:,} bytes, {_mib(needed)}"
    if free_files(folder) == 0:  # bytes to spare but no inode: every new file is refused
        note = f" but no file can be created there (0 inodes free){note}"
    return OSError(
        errno.ENOSPC,
        f"no space left on device: writing {what} ({size}) into "
        f"{folder}; {free:,} bytes ({_mib(free)}) are free there{note}. "
        "Free space on that file system or write elsewhere, then run "
        "again",
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors in `obj` (nested dicts, lists, tuples; each storage counted once,
    a DTensor by its local shard): about what `torch.save(obj)` writes, which adds a few KiB."""
    import torch

    total, seen, stack = 0, set[object](), [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack += list(x.values())
        elif isinstance(x, (list, tuple)):
            stack += list(x)
        elif isinstance(x, torch.Tensor):
            local = x.to_local() if hasattr(x, "to_local") else x
            try:
                storage = local.untyped_storage()
                key: object = (storage.data_ptr(), storage.nbytes())
                size = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
                key, size = id(local), local.numel() * local.element_size()
            if key not in seen:
                seen.add(key)
                total += size
    return total


# --------------------------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file at `path`, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, names: Iterable[str]) -> None:
    """Write `folder/manifest.json` with the size and sha256 of each file `names` in `folder`."""
    files = {
        name: {"bytes": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)}
        for name in names
    }
    write_bytes((json.dumps({"files": files}, indent=2) + "\n").encode(), folder / MANIFEST_FILE)


def verify_manifest(folder: Path, *, required: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Check every file listed in `folder/manifest.json` against its size and sha256, and that
    the manifest lists each of `required`. Returns the manifest's {name: {"bytes", "sha256"}}.

    Raises:
        CheckpointCorruptError: naming `folder` and the file, if the manifest is missing (a
            checkpoint written before checksums existed is refused too: it cannot be verified)
            or unreadable, lists no entry for a required file, or a file is missing, has another
            size (truncated, empty) or another sha256 (bit flip, overwritten).
    """
    files = _read_manifest(folder)
    unlisted = [name for name in required if name not in files]
    if unlisted:
        raise CheckpointCorruptError(
            f"checkpoint {folder}: {MANIFEST_FILE} lists no checksum "
            f"for {', '.join(unlisted)}, so it cannot be verified"
        )
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointCorruptError(f"checkpoint {folder}: {name} is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointCorruptError(
                f"checkpoint {folder}: {name} has {size} bytes where {MANIFEST_FILE} recorded "
                f"{entry['bytes']} (truncated or overwritten after the save)"
            )
        if sha256_file(path) != entry["sha256"]:
            raise CheckpointCorruptError(
                f"checkpoint {folder}: {name} does not match its sha256 in {MANIFEST_FILE} (its "
                "bytes changed after the save: disk corruption or tampering)"
            )
    return files


def _read_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointCorruptError(
            f"checkpoint {folder} has no {MANIFEST_FILE}, so its files cannot be verified: it was "
            "written before checkpoints carried checksums, or not by posttrain. posttrain loads "
            "verified checkpoints only; resume from another checkpoint or start a new run_dir"
        )
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
        ok = isinstance(files, dict) and all(
            _is_inside(name)
            and isinstance(entry["bytes"], int)
            and isinstance(entry["sha256"], str)
            for name, entry in files.items()
        )
    except (ValueError, KeyError, TypeError) as e:  # bad JSON or UTF-8, missing keys
        raise CheckpointCorruptError(
            f"checkpoint {folder}: {MANIFEST_FILE} is unreadable ({type(e).__name__}: {e})"
        ) from None
    if not ok:
        raise CheckpointCorruptError(
            f"checkpoint {folder}: {MANIFEST_FILE} is malformed (want "
            '{"files": {name: {"bytes": int, "sha256": str}}})'
        )
    return files


# --------------------------------------------------------------------------------------------
# Loading without running code
# --------------------------------------------------------------------------------------------


def _is_inside(name: str) -> bool:
    """A manifest entry names a file of the checkpoint folder or of one sub-folder (`sharded/`):
    relative, no `..`, at most two parts."""
    parts = PurePosixPath(name).parts
    return (
        str(PurePosixPath(name)) == name
        and 1 <= len(parts) <= 2
        and ".." not in parts
        and not PurePosixPath(name).is_absolute()
    )


_DCP_METADATA_GLOBALS = {
    ("pathlib", "PosixPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
}


def check_dcp_metadata(path: Path) -> None:
    """Check that a torch.distributed.checkpoint `.metadata` file (a pickle, which DCP loads with
    `pickle.load`) names only DCP's metadata classes, torch sizes, dtypes and layouts: it is
    unpickled here with every other global refused, so DCP's own load cannot run code.

    Raises:
        UnsafeCheckpointError: naming the file and the refused global.
    """
    import io

    import torch

    class _Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            allowed = (module, name) in _DCP_METADATA_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
            )
            if not allowed:
                raise UnsafeCheckpointError(
                    f"{path} would need {module}.{name} to unpickle; a sharded checkpoint's "
                    "metadata holds only torch.distributed.checkpoint classes, so it is refused "
                    "without being loaded"
                )
            return super().find_class(module, name)

    try:
        _Restricted(io.BytesIO(path.read_bytes())).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated, or not a pickle: any unpickling error
        raise UnsafeCheckpointError(
            f"{path} is not a readable sharded-checkpoint metadata file ({type(e).__name__}: {e})"
        ) from None


def check_weights_only(path: Path, what: str) -> None:
    """Check, without unpickling, that the torch file at `path` loads with weights_only=True.

    Raises:
        TypeError: if `what` (the object saved there) holds objects only full unpickling could
            rebuild (e.g. a numpy array or a custom class), named, so a checkpoint that could
            not be loaded is not written.
    """
    from torch.serialization import get_unsafe_globals_in_checkpoint

    unsafe = get_unsafe_globals_in_checkpoint(path)
    if unsafe:
        raise TypeError(
            f"{what} holds objects a checkpoint cannot store ({', '.join(unsafe)}): "
            "loading them would need full unpickling, which posttrain refuses "
            "because it can run code. Store tensors, numbers, strings, lists and "
            "dicts (e.g. torch.from_numpy for an array)"
        )


def read_weights_only(path: Path) -> Any:
    """`torch.load(path, weights_only=True)` onto the CPU, and nothing more permissive.

    Raises:
        UnsafeCheckpointError: naming the file, if unpickling it would need objects outside
            torch's weights-only allow-list (anything that could run code); it is not unpickled.
        CheckpointCorruptError: if torch cannot read the file at all.
    """
    import torch
    from torch.serialization import get_unsafe_globals_in_checkpoint

    try:
        unsafe = get_unsafe_globals_in_checkpoint(path)  # scans the pickle; runs nothing
        if not unsafe:
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        unsafe = [f"{e}".splitlines()[-1]]
    except (RuntimeError, ValueError, EOFError) as e:  # not a torch zip file, bad records
        raise CheckpointCorruptError(
            f"torch cannot read {path} ({type(e).__name__}: {e})"
        ) from None
    raise UnsafeCheckpointError(
        f"{path} needs objects outside torch's weights-only allow-list to load "
        f"({', '.join(unsafe)}); posttrain will not unpickle it, because unpickling can run "
        "arbitrary code. A posttrain checkpoint holds tensors and plain containers only: this "
        "file was not written by posttrain's save_checkpoint, or was tampered with"
    )
