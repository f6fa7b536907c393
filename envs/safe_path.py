"""A path under a directory an agent may have shaped, made safe to write as root: the relative path
must stay inside, every parent on the way becomes a real directory made here (a symlink or file in
its place is removed: it could point anywhere on the host), and whatever sits at the path itself is
cleared. Used for the task's files in a workspace and for the scoring copy."""

from __future__ import annotations

import os
import shutil


def clear_for_write(dest: str, rel: str, what: str = "path", inside: str = "its directory") -> str:
    """dest/rel with real parent directories and nothing at it; ValueError if rel leaves dest."""
    path = os.path.normpath(os.path.join(dest, rel))
    if os.path.isabs(rel) or not path.startswith(os.path.normpath(dest) + os.sep):
        raise ValueError(f"{what} {rel!r} leaves {inside}")
    cur = os.path.normpath(dest)
    for part in os.path.relpath(path, cur).split(os.sep)[:-1]:
        cur = os.path.join(cur, part)
        if os.path.islink(cur) or (os.path.lexists(cur) and not os.path.isdir(cur)):
            os.unlink(cur)
        if not os.path.isdir(cur):
            os.mkdir(cur)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    return path
