"""Budget sanity checks at open: a budget the machine cannot hold.

An in-memory provider (pinned) whose budget exceeds the machine's physical memory can only end
in an allocation failure or the OOM killer once it fills: refused (``InvalidArgumentError``).  A
persistent store (mmap, lmdb, and tiered through its slow tier) whose budget exceeds the free
space of its filesystem plus what the store already holds will hit ``NoSpaceError`` long before
its budget: a :class:`~hostkv_providers.errors.BudgetWarning` at the writer open that sets the
budget (not an error: the disk may be freed or grown later, and the store must still open).
Issue 16 item 14 (``pinned://?budget=100TiB`` on 24 GiB was accepted).
"""

from __future__ import annotations

import os
import stat
import warnings

from hostkv_providers._errors import BudgetWarning
from hostkv_providers._options import format_size

__all__ = ["check_disk_budget", "physical_memory", "store_disk_usage"]


def physical_memory() -> int:
    """Bytes of physical memory (0 where the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def store_disk_usage(path: str) -> int:
    """Bytes the regular files under ``path`` (two levels deep, symlinks not followed) occupy on
    disk; what a store already holds counts toward its budget."""
    total = 0
    stack = [(path, 0)]
    while stack:
        where, depth = stack.pop()
        try:
            with os.scandir(where) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        total += st.st_blocks * 512
                    elif stat.S_ISDIR(st.st_mode) and depth < 1:
                        stack.append((e.path, depth + 1))
        except OSError:
            continue
    return total


def check_disk_budget(path: str, budget: int, scheme: str, *, stacklevel: int = 3) -> bool:
    """Warn (:class:`BudgetWarning`) when ``budget`` exceeds the free space of ``path``'s
    filesystem plus what the store at ``path`` already occupies; ``True`` if it warned.  A
    filesystem that does not report its space (``statvfs`` fails) is not checked."""
    try:
        vfs = os.statvfs(path)
    except OSError:
        return False
    free = vfs.f_bavail * vfs.f_frsize
    room = free + store_disk_usage(path)
    if budget <= room:
        return False
    warnings.warn(
        f"{scheme}:// budget {format_size(budget)} exceeds what the filesystem of {path} can hold "
        f"({format_size(free)} free, {format_size(vfs.f_blocks * vfs.f_frsize)} in all): writes "
        "will fail with NoSpaceError before the budget is reached; lower budget= or free space",
        BudgetWarning, stacklevel=stacklevel)
    return True
