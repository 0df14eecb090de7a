"""Where a LoRA adapter's files are, and opening them (issue 58): a run-time load (`LoadLora`) names a
path a client sent, which must lie under `lora_root` once resolved (symlinks followed), and so must each file
in it; a relative path is taken under `lora_root`. A file is opened without following a last symlink, must be
a regular file, and is read whole only at the size it was opened with. Messages name the path as sent and
never a symlink's target, nor whether a path outside lora_root exists (either would map the worker's files
for whoever may call LoadLora); the worker's log has the resolved paths, for the operator.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

import structlog

from hetero_common.errors import ValidationError

log = structlog.get_logger("gpu_worker.lora.adapter_files")


class LoraAdapterError(ValidationError):
    """An adapter that cannot be served: the message says which file, key or shape, and what would fit."""


def run_time_root(lora_root: str | None, name: str) -> Path:
    """The directory a run-time load must lie under (`lora_root`, resolved), or LoraAdapterError when there is
    none: without it a client could make the worker read any file it can."""
    if lora_root is None:
        raise LoraAdapterError(f"LoRA adapter {name!r}: this worker loads no adapter at run time because its "
                               "lora_root is not set; set lora_root (env HETERO_LORA_ROOT, --lora-root) on the "
                               "worker to the directory holding the adapters, or load it at start with "
                               "lora_modules", "lora")
    try:
        return Path(lora_root).resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise LoraAdapterError(f"LoRA adapter {name!r}: the worker's lora_root cannot be read ({type(exc).__name__}); "
                               "check that the directory still exists", "lora") from exc


def _outside_root(name: str, path: Path) -> LoraAdapterError:
    # Neither the resolved target nor whether the path exists is told: either would map the worker's files
    # outside lora_root for whoever may call LoadLora. The worker's log says more, for the operator.
    return LoraAdapterError(f"LoRA adapter {name!r}: {str(path)!r} is not under the worker's lora_root (paths are "
                            "resolved, symlinks followed, on the worker); put the adapter's directory under "
                            "lora_root, as a copy rather than a symlink to elsewhere, or load it at start with "
                            "lora_modules", "lora")


def confined_directory(name: str, path: Path, root: Path) -> Path:
    """`path` (relative: under `root`) resolved, when it is a directory under `root`."""
    candidate = root / path  # an absolute `path` stays itself
    try:
        resolved = candidate.resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # missing, unreadable, a symlink loop
        if not _lexically_under(candidate, root):
            raise _outside_root(name, path) from None
        raise LoraAdapterError(f"LoRA adapter {name!r}: {str(path)!r} does not exist under the worker's lora_root "
                               f"({type(exc).__name__}); check the path (relative paths are taken under "
                               "lora_root)", "lora") from None
    if not resolved.is_relative_to(root):
        log.warning("LoRA path leads out of lora_root", adapter=name, path=str(path), resolved=str(resolved))
        raise _outside_root(name, path)
    if not resolved.is_dir():
        raise LoraAdapterError(f"LoRA adapter {name!r}: {str(path)!r} is not a directory (a PEFT adapter directory "
                               "holds adapter_config.json and adapter_model.safetensors)", "lora")
    return resolved


def _lexically_under(path: Path, root: Path) -> bool:
    return Path(os.path.normpath(path.absolute())).is_relative_to(root)


def open_file(name: str, directory: Path, shown: Path, root: Path | None) -> tuple[BinaryIO, int]:
    """The file `directory / shown.name` opened for reading, and its size: a regular file, and with `root`
    one whose resolved path lies under it. `shown` is the path as the caller sent it, for messages."""
    file = directory / shown.name
    missing = LoraAdapterError(f"LoRA adapter {name!r}: {str(shown)!r} is missing (a PEFT adapter directory holds "
                               "adapter_config.json and adapter_model.safetensors)", "lora")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # NONBLOCK: a FIFO does not hang the open
    if root is not None:
        try:
            file = file.resolve(strict=True)
        except (OSError, RuntimeError):
            raise missing from None
        if not file.is_relative_to(root):  # a symlinked file pointing out of lora_root
            log.warning("LoRA file leads out of lora_root", adapter=name, path=str(shown), resolved=str(file))
            raise _outside_root(name, shown)
        flags |= getattr(os, "O_NOFOLLOW", 0)  # resolved: a symlink here now was swapped in since
    try:
        fd = os.open(file, flags)
    except FileNotFoundError:
        raise missing from None
    except OSError as exc:
        raise LoraAdapterError(f"LoRA adapter {name!r}: cannot open {str(shown)!r} ({exc.strerror}); check that "
                               "the worker may read it", "lora") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # checked before fdopen, which refuses a directory untyped
            raise LoraAdapterError(f"LoRA adapter {name!r}: {str(shown)!r} is not a regular file", "lora")
        if root is not None and not _opened_under(fd, root):
            raise _outside_root(name, shown)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb"), info.st_size


def _opened_under(fd: int, root: Path) -> bool:
    """Whether what `fd` opened lies under `root`, where the system says (Linux's /proc): a directory of the
    path swapped for a symlink between the check and the open is caught here. True where it cannot say."""
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return True
    return Path(opened).is_relative_to(root)


def read_capped(name: str, stream: BinaryIO, size: int, shown: Path) -> bytes:
    """All of `stream` (`size` bytes as it was opened), or LoraAdapterError when it grew or shrank meanwhile."""
    try:
        data = stream.read(size + 1)
    except OSError as exc:
        raise LoraAdapterError(f"LoRA adapter {name!r}: cannot read {str(shown)!r} ({exc.strerror})", "lora") from None
    if len(data) != size:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {str(shown)!r} changed while it was read; load it again "
                               "once it is written", "lora")
    return data
