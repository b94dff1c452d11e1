"""The mode a file or directory made through `tempfile.mkstemp`/`mkdtemp` (0600/0700, whatever the umask) gets once
it is finished: the one `open()` or `os.mkdir()` would have given it, 0666/0777 less the process's umask. A user
whose umask is 077 (private click logs, a shared machine) keeps every output private; the usual 022 gives 0644 and
0755. (Before 2026-12-04 they were set to 0644/0755 outright: readable by every user whatever the umask said.)"""

from __future__ import annotations

import os


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``/proc/self/status``, kernel >= 4.7);
    elsewhere set and put back, to 077 meanwhile so that a file another thread creates in that moment is at most
    more private than asked, never less."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """An ordinary new file's mode under this process's umask (0644 under 022)."""
    return 0o666 & ~current_umask()


def dir_mode() -> int:
    """An ordinary new directory's mode under this process's umask (0755 under 022)."""
    return 0o777 & ~current_umask()
