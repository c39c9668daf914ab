"""A qemu guest with Debian's kernel, where SoftRoCE (``rdma_rxe``) gives real verbs on a machine whose own
kernel has none: built once per machine (``build.sh``, cached under ``CACHE`` and keyed by the script's
hash), booted under software emulation with a host folder shared over 9p, in which the guest runs one
command and leaves its output and exit status.

    from erdma_verbs import guest
    rc, out = guest.run(folder, "python3 -m pytest -q tests/guest", timeout=600)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

CACHE = Path(os.environ.get("ERDMA_GUEST_CACHE", "/var/cache/erdma-guest"))
BUILD = Path(__file__).with_name("build.sh")
BUILD_S = 1800.0  # about 100 s here; downloads on a slow mirror take longer


class GuestError(RuntimeError):
    pass


def missing() -> str | None:
    """Why the guest cannot be built and booted here, or None."""
    if os.geteuid() != 0:
        return "needs root (mmdebstrap, and the image under /var/cache)"
    for tool, package in (("qemu-system-x86_64", "qemu-system-x86"), ("mmdebstrap", "mmdebstrap"),
                          ("mkfs.ext4", "e2fsprogs")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed ({package}; scripts/system-deps.sh test installs it)"
    return None


def image() -> Path:
    """The cached guest for this version of ``build.sh``, built first when there is none (about 2 minutes; a
    build already under way, such as the one ``make test`` starts beside its installs, is waited for)."""
    where = CACHE / hashlib.sha256(BUILD.read_bytes()).hexdigest()[:16]
    if not (where / ".done").exists():
        try:
            out = subprocess.run(["bash", str(BUILD), str(where)], capture_output=True, text=True, timeout=BUILD_S)
        except subprocess.TimeoutExpired:
            raise GuestError(f"building the guest in {where} took over {BUILD_S:.0f}s (stopped)") from None
        if out.returncode:
            raise GuestError(f"building the guest in {where} failed ({out.returncode}): {out.stderr[-3000:]}")
    return where


def host_python() -> list[Path]:
    """What the guest needs to run this very interpreter and its environment (a virtualenv's editable
    installs included) at the same paths: the interpreter's prefix and the virtualenv's, unless that is the
    system's /usr (the guest has its own, the same Debian). Editable installs point into the checkout: share
    that too."""
    return [p for p in dict.fromkeys((Path(sys.base_prefix), Path(sys.prefix))) if p != Path("/usr")]


def run(folder: Path, command: str, timeout: float = 600.0, cpus: int = 2, memory: str = "2G",
        shares: Sequence[Path] = ()) -> tuple[int, str]:
    """Boot the guest with ``folder`` shared at /mnt/host, run ``command`` there (sh, in that folder) and return
    its exit status and output. ``shares``: host folders the guest mounts at the same paths before the
    command (read-only unless inside ``folder``). The image is used read-only (qemu -snapshot). GuestError
    when the guest leaves no status (it did not boot, or ``timeout`` seconds passed: it is killed)."""
    where = image()
    script, rc_file, out_file = folder / ".guest-cmd", folder / ".guest-rc", folder / ".guest-out"
    mounts, extra = [], []
    shares = [p for p in shares if not any(p != q and p.is_relative_to(q) for q in shares)]  # inside another: seen
    for i, path in enumerate(shares):
        ro = ",readonly=on" if not path.resolve().is_relative_to(folder.resolve()) else ""
        extra += ["-virtfs", f"local,path={path},mount_tag=share{i},security_model=none{ro}"]
        mounts.append(f"mkdir -p {path} && mount -t 9p -o trans=virtio,version=9p2000.L,msize=1048576,cache=loose "
                      f"share{i} {path}")
    script.write_text("".join(m + " || exit 90\n" for m in mounts) + command + "\n")
    rc_file.unlink(missing_ok=True)
    out_file.unlink(missing_ok=True)
    cmd = ["qemu-system-x86_64", "-accel", "tcg,thread=multi", "-cpu", "max", "-smp", str(cpus), "-m", memory,
           "-kernel", str(where / "vmlinuz"), "-initrd", str(where / "initrd.img"),
           "-append", "root=/dev/vda rw console=ttyS0 init=/sbin/erdma-init quiet panic=-1",
           "-drive", f"file={where / 'root.ext4'},format=raw,if=virtio", "-snapshot",
           "-virtfs", f"local,path={folder},mount_tag=host,security_model=none",
           *extra, "-nographic", "-no-reboot", "-net", "none"]
    try:
        console = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout
    except subprocess.TimeoutExpired as exc:
        raise GuestError(f"the guest did not finish within {timeout:.0f}s; console: "
                         f"{(exc.stdout or b'')[-2000:]!r}") from None
    if not rc_file.exists():
        raise GuestError(f"the guest left no exit status; console: {console[-3000:]}")
    return int(rc_file.read_text().strip() or "1"), out_file.read_text(errors="replace")
