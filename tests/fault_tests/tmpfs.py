"""A real, small tmpfs for disk-space faults (root only; callers skip with the reason otherwise)."""

import contextlib
import os
import subprocess


@contextlib.contextmanager
def small_tmpfs(path: str, size: str):
    """Mount a tmpfs of ``size`` at ``path`` for the block; yields None, or why it could not."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        yield "mounting a tmpfs needs root"
        return
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True, text=True)
    if p.returncode != 0:
        yield f"mount -t tmpfs failed: {p.stderr.strip()}"
        return
    try:
        yield None
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


def fill(path: str, leave_bytes: int = 0) -> int:
    """Fill the file system of ``path`` with a file of zeros until ``leave_bytes`` stay free (0:
    to the last byte); returns the bytes written."""
    target = os.path.join(path, "filler.bin")
    written = 0
    block = b"\0" * 4096
    with open(target, "ab", buffering=0) as f:
        for size in (4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
            try:
                while True:
                    st = os.statvfs(path)
                    if leave_bytes and st.f_bavail * st.f_frsize - size < leave_bytes:
                        break
                    written += f.write(block[:size])
            except OSError:
                pass
    return written
