"""Checkpoint directories `/update_weights_from_disk` may read: only below the server's `--weights-dir`s, and
never through a symbolic link.

The requested directory is reached from an allowed root one component at a time (`openat` with `O_NOFOLLOW`
under the previous component's descriptor), each `*.safetensors` file is opened the same way under the
directory's descriptor, checked to be a regular file, and read through that descriptor (`/proc/self/fd/N`, which
names the open file itself, not a path). Swapping a directory or a file for a link after the check changes
nothing: there is no second lookup by name. The roots themselves are the operator's and are opened as given.
"""

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager

import torch

MAX_PATH_CHARS = 4096  # PATH_MAX
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)  # a FIFO must not block


class OutsideError(ValueError):
    """The path is not below an allowed directory, or reaches it through a link (one answer: no oracle)."""


def check_path_text(path: str) -> None:
    """ValueError for a path no filesystem call should see: a NUL, over PATH_MAX, or not encodable."""
    if "\x00" in path:
        raise ValueError("the path holds a NUL character")
    if not path or len(path) > MAX_PATH_CHARS:
        raise ValueError(f"the path must have 1 to {MAX_PATH_CHARS} characters")
    try:
        os.fsencode(path)
    except UnicodeError:
        raise ValueError("the path is not valid text for this filesystem") from None


def _components(path: str, root: str) -> list[str] | None:
    """The components of `path` below `root` (lexically, after `..` is folded), or None when it is not below."""
    full, base = os.path.normpath(os.path.abspath(path)), os.path.normpath(os.path.abspath(root))
    if full == base:
        return []
    prefix = base.rstrip(os.sep) + os.sep
    return full[len(prefix) :].split(os.sep) if full.startswith(prefix) else None


@contextmanager
def open_below(path: str, roots: list[str]) -> Iterator[int]:
    """A descriptor of the directory `path`, reached from one of `roots` (as given, or resolved) without
    following a link. OutsideError when no root holds it that way; FileNotFoundError when it is missing there."""
    check_path_text(path)
    for root in roots:
        parts = _components(path, root)
        if parts is None:
            parts = _components(path, os.path.realpath(root))
        if parts is None:
            continue
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in parts:
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno == errno.ENOENT:
                        raise FileNotFoundError(f"no *.safetensors files in {path}") from None  # as a glob finds
                    raise OutsideError(path) from None  # a link (ELOOP), a file (ENOTDIR): not a way in
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)
        return
    raise OutsideError(path)


def read_safetensors_dir(path: str, roots: list[str]) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the `*.safetensors` files of the directory `path` below one of `roots` (module doc)."""
    from safetensors.torch import load_file

    with open_below(path, roots) as directory:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
        if not names:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        tensors: list[tuple[str, torch.Tensor]] = []
        for name in names:
            try:
                fd = os.open(name, _FILE_FLAGS, dir_fd=directory)
            except OSError as e:
                why = "is a symbolic link" if e.errno == errno.ELOOP else f"cannot be opened ({e.strerror})"
                raise ValueError(f"{name} in {path} {why}: only files that lie there are read") from None
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ValueError(f"{name} in {path} is not a regular file")
                tensors.extend(load_file(f"/proc/self/fd/{fd}").items())
            finally:
                os.close(fd)
    return tensors
