"""The audit's files: where ``--json`` may write, and writing the report there atomically."""

import contextlib
import math
import os
import stat
import uuid
from pathlib import Path
from typing import Any

from lightning_ckpt_determinism.audit.arguments import UsageError

__all__ = ["finite", "json_target", "replace_atomically"]

_SPECIAL_FILES = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a pipe"),
    (stat.S_ISSOCK, "a socket"),
)


def json_target(path: Path, configs: list[Path], option: str = "--json") -> Path:
    """The file ``--json`` (or another ``option`` that writes a file) names (through symbolic links), once it is known
    that the report can replace it.

    An existing path must be a regular file the user may write; the directory must take a new file, as the report
    is written beside the target first and then moved onto it. Nothing of the user's is removed.
    """
    target = Path(os.path.realpath(path))
    if any(target == Path(os.path.realpath(config)) for config in configs):
        raise UsageError(f"`{option}` {str(path)!r} is the `--config` file; give another path for the report")
    if target.exists():
        mode = target.stat().st_mode
        if stat.S_ISDIR(mode):
            raise UsageError(f"`{option}` {str(path)!r} is a directory; give the path of a file in it for the report")
        if not stat.S_ISREG(mode):
            kind = next((kind for test, kind in _SPECIAL_FILES if test(mode)), "not a regular file")
            raise UsageError(
                f"`{option}` {str(path)!r} is {kind}; the report goes to a new or an existing regular file: give the"
                " path of one"
            )
        if not os.access(target, os.W_OK):
            raise UsageError(
                f"`{option}` {str(path)!r} is read-only (mode {stat.S_IMODE(mode):o}); make it writable (chmod u+w) or"
                " give another path"
            )
    elif not target.parent.is_dir():
        raise UsageError(f"`{option}` {str(path)!r} cannot be written: {str(target.parent)!r} is no directory")
    try:
        os.unlink(_create_beside(target))
    except OSError as err:
        raise UsageError(
            f"`{option}` {str(path)!r} cannot be written: no new file can be made in {str(target.parent)!r}"
            f" ({err.strerror or err}); give a path in a writable directory"
        ) from err
    return target


def _create_beside(target: Path) -> Path:
    """A new empty file in ``target``'s directory, with the permissions a new file gets there (the umask's)."""
    temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    return temporary


def replace_atomically(target: Path, text: str) -> None:
    """Write ``text`` to a new file beside ``target`` and move it onto ``target``: a failed write (a full disk)
    leaves ``target`` as it was and no temporary file behind. An existing ``target`` keeps its permissions."""
    temporary = _create_beside(target)
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        if target.exists():
            os.chmod(temporary, stat.S_IMODE(target.stat().st_mode))
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def finite(value: Any) -> Any:
    """``value`` with non-finite floats as the strings ``"inf"``, ``"-inf"`` and ``"nan"``, which JSON lacks."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value
