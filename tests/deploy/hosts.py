"""Real systemd hosts for the deployment tests: systemd-nspawn containers on a bridge.

Follows shared/reference/test-hosts.md. A Debian 12 root file system is built once
with debootstrap and cached in ``/var/cache/kiwi-test-hosts/<key>/root`` (``key``
hashes the package list and the preparation steps; ``KIWI_TEST_HOSTS_CACHE``
moves the cache). Every host boots that tree with ``--volatile=overlay``, so the
cache stays pristine and a host's changes vanish at power-off.

:class:`Fleet` owns everything it makes (the bridge and its /24, one cgroup per
host in each host hierarchy, the hosts, an SSH key, a work directory) and removes
all of it in :meth:`Fleet.close`, whatever happened before. It never touches a
bridge, cgroup or process that it did not create.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

SUITE = "bookworm"
# What a host needs: systemd as PID 1 with a bus, sshd for Ansible, Python with
# venv (the role's virtualenv), packaging (Ansible's pip module) and apt (Ansible's
# package module, which finds them installed and needs no network).
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "iproute2",
    "openssh-server",
    "python3",
    "python3-venv",
    "python3-packaging",
    "python3-apt",
    "sudo",
)
# Changing how the tree is prepared must change the cache key: bump this.
PREPARE_VERSION = "1"
CACHE_ROOT = Path(os.environ.get("KIWI_TEST_HOSTS_CACHE", "/var/cache/kiwi-test-hosts"))
CGROUP = Path("/sys/fs/cgroup")
TOOLS = ("systemd-nspawn", "debootstrap", "nsenter", "ip", "ssh", "ssh-keygen")


class HostError(Exception):
    """A host could not be built, booted, reached or stopped."""


def wait_for(predicate: Callable[[], T], timeout: float, what: str) -> T:
    """Poll ``predicate`` until it returns something truthy; raise at the deadline."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def missing_tools() -> list[str]:
    """The host tools of :data:`TOOLS` that are not on PATH."""
    return [tool for tool in TOOLS if shutil.which(tool) is None]


# ---------------------------------------------------------------- root file system


def debian_mirror() -> str:
    """The first Debian mirror this machine's apt uses."""
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.exists():
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:") and line.split()[1:]:
                return line.split()[1]
    legacy = Path("/etc/apt/sources.list")
    if legacy.exists():
        for line in legacy.read_text().splitlines():
            parts = line.split()
            if parts[:1] == ["deb"]:
                urls = [p for p in parts[1:] if "://" in p]
                if urls:
                    return urls[0]
    return "http://deb.debian.org/debian"


def cache_key(extra: tuple[str, ...] = ()) -> str:
    packages = sorted({*PACKAGES, *extra})
    text = json.dumps([SUITE, packages, PREPARE_VERSION])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ensure_rootfs(log: Callable[[str], None] = print, extra: tuple[str, ...] = ()) -> Path:
    """Return the cached root file system, building it first on a cache miss.

    ``extra`` adds Debian packages (a tree of its own in the cache): the plain tree
    is copied and apt installs them into the copy (debootstrap's own resolver
    fails on some, e.g. podman's golang-github-containers-common). A lock file
    serialises concurrent builders; the tree is built next to its final place and
    renamed into it, so a half-built tree is never used.
    """
    plain = ensure_rootfs(log) if extra else None
    base = CACHE_ROOT / cache_key(extra)
    root = base / "root"
    if (base / "complete").exists():
        return root
    base.mkdir(parents=True, exist_ok=True)
    with open(base / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (base / "complete").exists():
            return root
        started = time.monotonic()
        build = Path(tempfile.mkdtemp(prefix="build-", dir=base))
        try:
            tree = build / "root"
            if plain is None:
                mirror = debian_mirror()
                log(f"building the test-host root file system from {mirror} (cache miss)")
                include = f"--include={','.join(PACKAGES)}"
                _run(["debootstrap", "--variant=minbase", include, SUITE, str(tree), mirror])
                _prepare(tree)
            else:
                log(f"adding {', '.join(extra)} to a copy of {plain} (cache miss)")
                _run(["cp", "-a", str(plain), str(tree)])
                _apt_install(tree, extra)
            if root.exists():
                shutil.rmtree(root)
            tree.rename(root)
        finally:
            shutil.rmtree(build, ignore_errors=True)
        (base / "complete").write_text(f"{time.monotonic() - started:.0f} s\n")
        log(f"built {root} in {time.monotonic() - started:.0f} s")
    return root


def _run(argv: list[str]) -> None:
    try:
        subprocess.run(argv, check=True, capture_output=True, timeout=900)
    except subprocess.CalledProcessError as err:
        raise HostError(
            f"{argv[0]} failed ({err.returncode}):\n{err.stdout.decode()[-3000:]}"
            f"\n{err.stderr.decode()[-3000:]}"
        ) from err


def _apt_install(tree: Path, packages: tuple[str, ...]) -> None:
    """``apt-get install`` into ``tree`` through chroot, with /proc mounted meanwhile."""
    proc = tree / "proc"
    _run(["mount", "-t", "proc", "proc", str(proc)])
    try:
        env = "DEBIAN_FRONTEND=noninteractive"
        _run(["chroot", str(tree), "env", env, "apt-get", "update", "-qq"])
        install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]
        _run(["chroot", str(tree), "env", env, *install])
        _run(["chroot", str(tree), "apt-get", "clean"])
        # Programs, not services: nothing the packages enabled starts with the host.
        subprocess.run(
            ["systemctl", f"--root={tree}", "disable", "prometheus.service"],
            check=False,
            capture_output=True,
        )
    finally:
        subprocess.run(["umount", str(proc)], check=False, capture_output=True)


def _prepare(tree: Path) -> None:
    """Make the tree bootable many times over: no fixed identity, root by key, networkd."""
    (tree / "etc/hostname").unlink(missing_ok=True)
    (tree / "etc/machine-id").write_text("")
    dbus_id = tree / "var/lib/dbus/machine-id"
    dbus_id.unlink(missing_ok=True)
    dbus_id.symlink_to("/etc/machine-id")
    subprocess.run(["chroot", str(tree), "passwd", "-d", "root"], check=True, capture_output=True)
    ssh = tree / "root/.ssh"
    ssh.mkdir(mode=0o700, exist_ok=True)
    (ssh / "authorized_keys").write_text("")  # each fleet binds its own key over it
    subprocess.run(
        ["chroot", str(tree), "systemctl", "enable", "systemd-networkd"],
        check=True,
        capture_output=True,
    )
    subprocess.run(["chroot", str(tree), "apt-get", "clean"], check=True, capture_output=True)


# ---------------------------------------------------------------- cgroups of the hosts


def _host_hierarchies() -> list[Path]:
    """Where this machine's own cgroups live: the v1 name=systemd and the cgroup2 trees."""
    found = []
    if (CGROUP / "systemd" / "cgroup.procs").exists():
        found.append(CGROUP / "systemd")
    if (CGROUP / "unified" / "cgroup.procs").exists():
        found.append(CGROUP / "unified")
    elif (CGROUP / "cgroup.controllers").exists():
        found.append(CGROUP)
    return found


def hybrid_supported() -> bool:
    """Whether a host may boot with the hybrid layout (this machine has it)."""
    return (CGROUP / "systemd" / "cgroup.procs").exists()


def _remove_cgroup_tree(top: Path) -> None:
    """Remove ``top`` and its children bottom-up, killing what is left in them."""
    if not top.exists():
        return
    dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
    for directory in [*dirs, top]:
        for _attempt in range(50):
            try:
                directory.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                _kill_cgroup(directory)
                time.sleep(0.1)


def _kill_cgroup(directory: Path) -> None:
    kill = directory / "cgroup.kill"
    if kill.exists():
        with contextlib.suppress(OSError):
            kill.write_text("1")
        return
    with contextlib.suppress(OSError):
        for pid in (directory / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)


# ---------------------------------------------------------------- hosts


@dataclass
class Host:
    """One booted systemd-nspawn container."""

    name: str
    address: str
    layout: str  # "unified" or "hybrid"
    proc: subprocess.Popen[bytes] | None = None
    cgroups: list[Path] = field(default_factory=list)
    console: Path | None = None
    _pid1: int | None = None

    @property
    def pid1(self) -> int:
        """The host's PID 1 (systemd), as this machine numbers it."""
        if self._pid1 is None:
            self._pid1 = wait_for(self._find_pid1, 30, f"{self.name}'s systemd to start")
        return self._pid1

    def _find_pid1(self) -> int | None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise HostError(f"{self.name}: systemd-nspawn exited with {self.proc.returncode}")
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                text = stat.read_text()
                comm = text[text.index("(") + 1 : text.rindex(")")]
                ppid = int(text[text.rindex(")") + 2 :].split()[1])
                if ppid == self.proc.pid and comm == "systemd":
                    return int(stat.parent.name)
        return None

    def run(
        self, *argv: str, check: bool = True, timeout: float = 60, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside the host (all its namespaces) and return its output."""
        done = subprocess.run(
            ["nsenter", "-t", str(self.pid1), "-a", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
            check=False,
        )
        if check and done.returncode != 0:
            raise HostError(
                f"{self.name}: {' '.join(argv)} exited with {done.returncode}:\n"
                f"{done.stdout}{done.stderr}"
            )
        return done

    def sh(self, script: str, check: bool = True, timeout: float = 60) -> str:
        """Run a shell script inside the host and return its standard output."""
        return self.run("sh", "-c", script, check=check, timeout=timeout).stdout

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """``systemctl show UNIT -p ...`` as a dict."""
        out = self.run("systemctl", "show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_running(self, timeout: float = 60) -> str:
        """Wait until systemd says the host is up (running or degraded)."""

        def state() -> str | None:
            out = self.run("systemctl", "is-system-running", "--wait", check=False, timeout=30)
            answer = out.stdout.strip()
            return answer if answer in ("running", "degraded") else None

        return wait_for(state, timeout, f"{self.name} to finish booting")


class Fleet:
    """A bridge, its /24 and the hosts booted on it; :meth:`close` removes them all."""

    def __init__(
        self,
        rootfs: Path,
        layouts: list[str],
        binds: tuple[tuple[Path, str], ...] = (),
        nspawn_args: tuple[str, ...] = (),
    ) -> None:
        self.rootfs = rootfs
        self.binds = binds  # (directory here, path in every host), read-only
        self.nspawn_args = nspawn_args  # more systemd-nspawn options for every host
        self.tag = secrets.token_hex(3)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"kiwi-deploy-{self.tag}-"))
        self.bridge = f"kiwibr-{self.tag}"
        self.key = self.workdir / "id_ed25519"
        # The bridge's /24 and so the addresses are chosen in start().
        self.net: ipaddress.IPv4Network
        self.gateway: str
        self.hosts = [
            Host(f"kt{self.tag}-{i}", "", layout) for i, layout in enumerate(layouts, start=1)
        ]
        self._bridge_made = False

    # ---------------------------------------------------------------- start

    def start(self, timeout: float = 120) -> None:
        """Create the bridge, boot every host and wait until each answers SSH."""
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)], check=True
        )
        # Another fleet may be starting beside this one (pytest-xdist): choosing a free
        # /24 and taking it with the bridge's address is one step for each, in turn.
        with _machine_lock("subnet"):
            self.net = _free_subnet()
            subprocess.run(["ip", "link", "add", self.bridge, "type", "bridge"], check=True)
            self._bridge_made = True
            self.gateway = str(self.net.network_address + 1)
            subprocess.run(
                ["ip", "addr", "add", f"{self.gateway}/{self.net.prefixlen}", "dev", self.bridge],
                check=True,
            )
        for i, host in enumerate(self.hosts, start=1):
            host.address = str(self.net.network_address + 10 + i)
        subprocess.run(["ip", "link", "set", self.bridge, "up"], check=True)
        for host in self.hosts:
            self._boot(host)
        for host in self.hosts:
            host.wait_running(timeout)
        for host in self.hosts:
            wait_for(lambda h=host: self._ssh_ok(h), timeout, f"SSH on {host.name}")

    def _boot(self, host: Host) -> None:
        network = self.workdir / f"{host.name}.network"
        network.write_text(
            f"[Match]\nName=host0\n\n[Network]\nAddress={host.address}/{self.net.prefixlen}\n"
        )
        for hierarchy in _host_hierarchies():
            cgroup = hierarchy / f"kiwi-deploy-{host.name}"
            cgroup.mkdir()
            host.cgroups.append(cgroup)
        env = {**os.environ, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
        if host.layout == "hybrid":
            env.pop("SYSTEMD_NSPAWN_UNIFIED_HIERARCHY")
        env.pop("NOTIFY_SOCKET", None)
        host.console = self.workdir / f"{host.name}.console"
        nspawn = [
            "systemd-nspawn",
            "-q",
            "-D",
            str(self.rootfs),
            "-b",
            f"--machine={host.name}",
            f"--hostname={host.name}",
            f"--uuid={_uuid()}",
            "--volatile=overlay",
            "--register=no",
            "--keep-unit",
            "--console=read-only",
            f"--network-bridge={self.bridge}",
            f"--bind-ro={network}:/etc/systemd/network/10-host0.network",
            f"--bind-ro={self.key}.pub:/root/.ssh/authorized_keys",
            *(f"--bind-ro={source}:{target}" for source, target in self.binds),
            *self.nspawn_args,
        ]
        # The starting shell moves itself into the host's own cgroups, then becomes
        # systemd-nspawn: every host's systemd then owns a cgroup of its own.
        moves = " ".join(f'echo $$ > "{c}/cgroup.procs";' for c in host.cgroups)
        with open(host.console, "wb") as console:
            host.proc = subprocess.Popen(
                ["sh", "-c", f'{moves} exec "$@"', "sh", *nspawn],
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def _ssh_ok(self, host: Host) -> bool:
        done = subprocess.run(
            [*self.ssh_command(host), "true"], capture_output=True, timeout=30, check=False
        )
        return done.returncode == 0

    def ssh_command(self, host: Host) -> list[str]:
        return [
            "ssh",
            "-i",
            str(self.key),
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
            "-o",
            "ConnectTimeout=5",
            f"root@{host.address}",
        ]

    # ---------------------------------------------------------------- stop

    def close(self) -> None:
        """Power every host off, then remove cgroups, bridge and work directory.

        Each step runs even when an earlier one failed; the first error is raised last.
        """
        errors: list[BaseException] = []
        for host in self.hosts:
            if host.proc is not None and host.proc.poll() is None and host._pid1 is not None:
                with contextlib.suppress(HostError, subprocess.TimeoutExpired):
                    host.run("systemctl", "poweroff", "--no-block", timeout=10)
        for host in self.hosts:
            try:
                _stop(host)
            except BaseException as err:  # keep cleaning up; raised below
                errors.append(err)
            for cgroup in reversed(host.cgroups):
                _remove_cgroup_tree(cgroup)
        if self._bridge_made:
            subprocess.run(["ip", "link", "del", self.bridge], check=False, capture_output=True)
        shutil.rmtree(self.workdir, ignore_errors=True)
        if errors:
            raise errors[0]


def _stop(host: Host, timeout: float = 30) -> None:
    """Wait for a host to power off; kill its systemd-nspawn after ``timeout``."""
    if host.proc is None:
        return
    if host._pid1 is None and host.proc.poll() is None:
        host.proc.terminate()  # never booted far enough to be asked to power off
    try:
        host.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        host.proc.kill()  # our own systemd-nspawn, by its PID
        host.proc.wait(timeout=30)


@contextlib.contextmanager
def _machine_lock(name: str) -> Iterator[None]:
    """An exclusive lock on this machine, held by one process (of any test run) at a time."""
    with open(f"/run/kiwi-test-hosts-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _uuid() -> str:
    return Path("/proc/sys/kernel/random/uuid").read_text().strip()


def _free_subnet() -> ipaddress.IPv4Network:
    """A random 10.231.N.0/24 that no route on this machine overlaps."""
    out = subprocess.run(
        ["ip", "-4", "-j", "route", "show", "table", "all"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    used: list[ipaddress.IPv4Network] = []
    for route in json.loads(out or "[]"):
        dst = route.get("dst", "")
        if re.match(r"^\d+\.\d+\.\d+\.\d+(/\d+)?$", dst):
            used.append(ipaddress.IPv4Network(dst, strict=False))
    for _attempt in range(100):
        net = ipaddress.IPv4Network(f"10.231.{secrets.randbelow(256)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise HostError("no free 10.231.N.0/24 for the test bridge")


def jsonish(text: str) -> Any:
    """Parse JSON output of a command, with the text in the error if it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise HostError(f"not JSON: {text[:2000]!r}") from err
