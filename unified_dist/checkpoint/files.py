"""Checkpoints that move between backends and never execute code on load.

``save`` turns prepared objects into plain state (models unwrapped, so no ``module.`` prefix;
tensors on the CPU), and the main process writes it atomically: a temporary file in the same
directory, fsync, then ``os.replace``; a crash mid-write leaves the previous file intact.
``load`` uses ``torch.load(weights_only=True)``: tensors, numbers, strings and containers only.
"""
from __future__ import annotations

import os
import pickle
import re
import secrets
import shutil
import zipfile
from collections import OrderedDict
from typing import Any, Callable, List, Optional, Tuple

import torch

from .. import nested
from ..errors import CheckpointError, first_line


def _on_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu()


def to_state(obj: Any, unwrap: Callable[[torch.nn.Module], torch.nn.Module],
             tensor: Callable[[torch.Tensor], Any] = _on_cpu,
             module_state: Optional[Callable[[torch.nn.Module], dict]] = None) -> Any:
    """Plain, portable state: modules/optimizers/schedulers/loaders become their state dicts (a module's
    ``module_state(module)`` where given, the backend's: else its unwrapped ``state_dict()``),
    tensors become ``tensor(t)`` (a CPU copy by default), dicts become plain ``dict``/``OrderedDict``
    without DDP's ``module.``. Tensors are visited in the same order on every rank."""

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.nn.Module):
            state = module_state(value) if module_state is not None else unwrap(value).state_dict()
            return to_state(state, unwrap, tensor, module_state)
        if isinstance(value, torch.Tensor):
            return tensor(value)
        if hasattr(value, "state_dict") and callable(value.state_dict):
            return to_state(value.state_dict(), unwrap, tensor, module_state)
        return value

    return nested.map_leaves(leaf, obj, _plain)


def _plain(container: Any, items: Any) -> Any:
    if not isinstance(container, dict):
        return nested.same_type(container, items)
    keys = [k for k, _ in items]
    if keys and all(isinstance(k, str) and k.startswith("module.") for k in keys):
        items = [(k[len("module."):], v) for k, v in items]  # a DDP-wrapped state dict
    return OrderedDict(items) if isinstance(container, OrderedDict) else dict(items)


def _create_temporary(directory: str, name: str) -> Tuple[int, str]:
    """A new file ``directory/.name.<random>.tmp`` opened for writing, created with mode 0666 less
    the umask (as ``open`` or ``torch.save`` would create ``name``; ``tempfile.mkstemp``'s 0600
    would survive the rename and hide checkpoints from colleagues on a shared cluster)."""
    while True:
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


FULL_BYTES = 16 * 2**20
"""A failed write that leaves less than this free on the checkpoint's filesystem is reported as a full disk."""


def write_atomic(state: Any, path: str) -> None:
    """Write ``state`` to ``path`` so that readers see the old file or the whole new one; the file's
    mode follows the umask (0644 under the usual 022), like any file the user creates. A write that
    fails on a full filesystem raises :class:`CheckpointError` saying so (torch's own message is an
    ``unexpected pos`` from its zip writer)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = _create_temporary(directory, os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        full = _disk_full(path, tmp) if isinstance(exc, Exception) else None
        if os.path.exists(tmp):
            os.unlink(tmp)
        if full:
            raise CheckpointError(full) from exc
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _disk_full(path: str, tmp: str) -> Optional[str]:
    """The one-line reason when the failed write of ``path`` (so far in ``tmp``) filled its filesystem."""
    try:
        free = shutil.disk_usage(os.path.dirname(tmp)).free
        written = os.path.getsize(tmp) if os.path.exists(tmp) else 0
    except OSError:
        return None
    if free >= FULL_BYTES:
        return None
    return (f"the filesystem of {path} is full ({free / 2**20:.0f} MiB free after writing "
            f"{written / 2**20:.0f} MiB of it); free space there or save to another filesystem "
            "(any previous file there is intact)")


def read_safe(path: str, map_location: Optional[Any] = None) -> Any:
    """Load a checkpoint with ``weights_only=True``; every failure is one actionable line."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} does not exist; check the path (or start without --resume)")
    try:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = first_line(exc)
        if "Weights only load failed" in reason or "weights_only" in str(exc):
            reason = next((line.strip() for line in str(exc).splitlines()
                           if "Unsupported global" in line or "GLOBAL" in line), reason)
            raise CheckpointError(
                f"refusing to load {path}: it holds pickled code or objects that weights_only=True "
                f"does not allow ({reason}); save plain state with ud.save") from None
        raise CheckpointError(f"{path} is not a torch checkpoint ({reason})") from None
    except Exception as exc:  # zip/pickle errors of a truncated or foreign file take many forms
        first = first_line(exc)
        raise CheckpointError(
            f"{path} is truncated or not a torch checkpoint ({first}); use an earlier checkpoint") from None


_NAME = re.compile(r"^checkpoint-(\d+)\.pt$")


def checkpoint_path(directory: str, step: int) -> str:
    """Where :func:`rotate` expects step ``step``'s checkpoint: ``directory/checkpoint-<step>.pt``."""
    return os.path.join(directory, f"checkpoint-{step:09d}.pt")


def _listed(directory: str) -> List[Tuple[int, str]]:
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), os.path.join(directory, name))
             for name in os.listdir(directory) if (m := _NAME.match(name))]
    return sorted(found)


def looks_complete(path: str) -> bool:
    """Cheap integrity check: a torch zip archive whose central directory reads back."""
    try:
        with zipfile.ZipFile(path) as archive:
            return bool(archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def check_keep_last(keep_last: int) -> None:
    """Raise :class:`CheckpointError` unless ``keep_last`` keeps at least one checkpoint."""
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1, got {keep_last}; keep at least the newest checkpoint")


def rotate(directory: str, keep_last: int, newest: str) -> None:
    """Delete all but the ``keep_last`` newest checkpoints; never ``newest`` (just written)."""
    check_keep_last(keep_last)
    if not looks_complete(newest):
        return  # never delete older ones unless the new one is good
    listed = [path for _, path in _listed(directory)]
    for path in listed[:-keep_last]:
        if os.path.abspath(path) != os.path.abspath(newest):
            os.unlink(path)


def latest(directory: str) -> Optional[str]:
    """The newest complete checkpoint in ``directory`` (by step), or ``None``."""
    for _, path in reversed(_listed(directory)):
        if looks_complete(path):
            return path
    return None
