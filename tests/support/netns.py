"""Several "hosts" on one machine for multi-host tests: Linux network namespaces joined
by veth pairs to a bridge that lives in a namespace of its own (the "switch").

    with Topology(["broker", "worker0"]) as net:      # 10.77.0.1, 10.77.0.2
        procs.spawn(..., prefix=net.exec_prefix("broker"))
        net.set_link("worker0", up=False)              # pull the worker's cable
        with net.executor("broker") as pool: ...       # sockets of the test process inside a namespace

Nothing is added to the root namespace (no route, no interface, no address), so the
subnet cannot clash with the machine's own network or with a parallel run, and every
run names its namespaces after its pid and a random tag: a run that crashed without
cleaning up never breaks the next one (and the next one sweeps its namespaces).
Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN); ``unavailable_reason()`` says why not.
"""
from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

SUBNET = "10.77.0"
PREFIX = "tsn"  # every namespace of ours: tsn<pid>x<tag>-<role>
_NAME = re.compile(rf"^{PREFIX}(\d+)x[0-9a-f]+-")
CLONE_NEWNET = 0x40000000


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable_reason() -> Optional[str]:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add, veth, a bridge)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def sweep_stale() -> None:
    """Delete namespaces left by runs whose process is gone (killed before its cleanup)."""
    listing = _ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _ip("netns", "del", name, check=False)


def setns(name: str) -> None:
    """Move the calling thread (only it) into namespace ``name``; sockets it opens live there."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


class Topology:
    """One namespace per role, each with ``eth0`` = SUBNET.<i+1>/24 on a shared bridge."""

    def __init__(self, roles: list[str]):
        self.tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.switch = f"{self.tag}-sw"
        self.roles = list(roles)
        self.address = {role: f"{SUBNET}.{i + 1}" for i, role in enumerate(self.roles)}
        self._made: list[str] = []

    def ns(self, role: str) -> str:
        return f"{self.tag}-{role}"

    def _port(self, role: str) -> str:
        return f"p{self.roles.index(role)}"  # the role's port on the bridge, inside the switch

    def up(self) -> "Topology":
        sweep_stale()
        for name in (self.switch, *map(self.ns, self.roles)):
            _ip("netns", "add", name)
            self._made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")  # processes also talk to themselves
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for role in self.roles:
            # Both ends are created straight in their namespaces: no name ever lands in the root one.
            _ip("-n", self.switch, "link", "add", self._port(role), "type", "veth", "peer", "name", "eth0",
                "netns", self.ns(role))
            _ip("-n", self.switch, "link", "set", self._port(role), "master", "br0", "up")
            _ip("-n", self.ns(role), "addr", "add", f"{self.address[role]}/24", "dev", "eth0")
            _ip("-n", self.ns(role), "link", "set", "eth0", "up")
        return self

    def exec_prefix(self, role: str) -> list[str]:
        """Command prefix that runs a program inside ``role``'s namespace (it execs: same pid)."""
        return ["ip", "netns", "exec", self.ns(role)]

    def set_link(self, role: str, up: bool) -> None:
        """Plug or pull ``role``'s cable.  Down on the host's own side: its routes go with it,
        so its reconnect attempts fail at once and it reconnects as soon as it is back."""
        _ip("-n", self.ns(role), "link", "set", "eth0", "up" if up else "down")

    def link_is_up(self, role: str) -> bool:
        return "state UP" in _ip("-n", self.ns(role), "link", "show", "eth0").stdout

    def executor(self, role: str, workers: int = 4) -> ThreadPoolExecutor:
        """Threads living in ``role``'s namespace: the test's own clients run there.

        libzmq starts its I/O threads when a context opens its first socket, from the
        calling thread, so a zmq.Context created *and first used* in one of these threads
        lives in the namespace too."""
        return ThreadPoolExecutor(workers, thread_name_prefix=f"netns-{role}", initializer=setns,
                                  initargs=(self.ns(role),))

    def down(self) -> None:
        """Delete every namespace made (their veths and the bridge go with them)."""
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()

    def __enter__(self) -> "Topology":
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()

