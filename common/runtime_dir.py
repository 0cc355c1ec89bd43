"""The private runtime directory of a single-host stack: the broker's ipc:// sockets and
the shared secrets (control and worker tokens) live there.

Location: ``$TOKSERVE_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/tokserve``, else
``/tmp/tokserve-<uid>``.  It is created mode 0700; an existing one must be a real
directory (not a symlink) owned by us with no group/other permission bits: another
local user could otherwise pre-create ``/tmp/tokserve-<uid>`` and read our tokens or
plant its own socket where our clients connect.

Tokens (``secrets.token_urlsafe(32)``) are files of mode 0600, created atomically by
whichever process needs one first (a temporary file hard-linked into place, so a
reader never sees a half-written token) and read by the others:

* ``control.token``: what a client must present for CONTROL commands (trainers, a
  gateway with --enable-rl / --allow-runtime-lora);
* ``worker.token``: what a worker must present in its READY to be registered.

Across hosts the operator copies the file and points ``--control-token-file`` /
``--worker-token-file`` (or ``TOKSERVE_CONTROL_TOKEN_FILE`` /
``TOKSERVE_WORKER_TOKEN_FILE``) at the copy.
"""
from __future__ import annotations

import errno
import hmac
import ipaddress
import os
import secrets
import socket
import stat
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

CONTROL = "control"
WORKER = "worker"
_TOKEN_ENV = {CONTROL: "TOKSERVE_CONTROL_TOKEN_FILE", WORKER: "TOKSERVE_WORKER_TOKEN_FILE"}
FRONTEND_SOCKET = "frontend.sock"
BACKEND_SOCKET = "backend.sock"
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes with the terminating NUL


class RuntimeDirError(RuntimeError):
    """The runtime directory or a token file is unusable (wrong owner, permissions, ...)."""


def path() -> Path:
    """Where the runtime directory is (nothing is created or checked)."""
    explicit = os.environ.get("TOKSERVE_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "tokserve"
    return Path("/tmp") / f"tokserve-{os.getuid()}"


def _check_private(directory: Path) -> None:
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"runtime directory {directory} is not a real directory (a symlink or a file): "
                              f"remove it or set TOKSERVE_RUNTIME_DIR to a private directory")
    if st.st_uid != os.getuid():
        raise RuntimeDirError(f"runtime directory {directory} belongs to uid {st.st_uid}, not to us "
                              f"(uid {os.getuid()}): refusing to use it; set TOKSERVE_RUNTIME_DIR")
    if st.st_mode & 0o077:
        raise RuntimeDirError(f"runtime directory {directory} has mode {stat.S_IMODE(st.st_mode):04o}; it must be "
                              f"private (0700): chmod 700 {directory}, or set TOKSERVE_RUNTIME_DIR")


def ensure() -> Path:
    """The runtime directory, created 0700 if missing; RuntimeDirError if it is not private."""
    directory = path()
    try:
        os.makedirs(directory.parent, mode=0o700, exist_ok=True)
        os.mkdir(directory, 0o700)  # the umask can only remove bits: never wider than 0700
    except FileExistsError:
        pass  # made by another process of the stack, or a leftover: checked below either way
    except OSError as exc:
        raise RuntimeDirError(f"cannot create runtime directory {directory}: {exc}") from None
    _check_private(directory)
    return directory


def ipc_endpoint(name: str) -> str:
    """``ipc://`` endpoint of socket ``name`` in the runtime directory (not created here)."""
    return f"ipc://{path() / name}"


def ipc_path(endpoint: str) -> Optional[str]:
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


def prepare_ipc_bind(endpoint: str) -> None:
    """Before a broker binds ``endpoint``: for ipc://, make its folder (the runtime
    directory: private) and refuse when a live process already listens on the path.
    libzmq would silently unlink that socket and take the path over, stranding the
    other broker's peers."""
    sock_path = ipc_path(endpoint)
    if sock_path is None:
        return
    if len(os.fsencode(sock_path)) > _SUN_PATH_MAX:
        raise RuntimeDirError(f"ipc path {sock_path} is longer than {_SUN_PATH_MAX} bytes (a Unix socket limit): "
                              f"use a shorter TOKSERVE_RUNTIME_DIR")
    if Path(sock_path).parent == path():
        ensure()
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(sock_path)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return  # a stale socket file left by a dead broker: libzmq replaces it
        raise RuntimeDirError(f"cannot probe {sock_path}: {exc}") from None
    finally:
        probe.close()
    raise RuntimeDirError(f"another process is already listening on {endpoint}: is a broker running? Stop it, or "
                          f"bind elsewhere (--frontend / --backend, or TOKSERVE_RUNTIME_DIR)")


def check_before_connect(endpoint: str) -> None:
    """Before connecting to an ipc:// socket of the runtime directory (or reading a file
    there): refuse a directory someone else could have planted a socket in."""
    sock_path = ipc_path(endpoint)
    if sock_path is None or Path(sock_path).parent != path():
        return
    try:
        _check_private(path())
    except FileNotFoundError:
        return  # no broker yet: nothing to connect to, ZeroMQ retries until one binds


def is_local_endpoint(endpoint: str) -> bool:
    """True for ipc:// / inproc:// and TCP on a loopback address or ``localhost``;
    False for anything another host could reach (0.0.0.0, *, an interface address,
    a host name)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = urlsplit(f"tcp://{rest}").hostname if not rest.startswith("*") else "*"
    if host is None or host == "*":
        return False
    if host == "localhost":
        return True
    if "%" in host:  # an interface name; loopback only when it is "lo"
        host, _, iface = host.partition("%")
        if iface != "lo":
            return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or an interface name: may well be reachable from elsewhere


# --------------------------------------------------------------------------- tokens
def token_path(kind: str, override: Optional[str] = None) -> Path:
    """The token file of ``kind``: the flag's value, else the environment variable, else
    the runtime directory's ``<kind>.token``."""
    explicit = override or os.environ.get(_TOKEN_ENV[kind])
    return Path(explicit) if explicit else path() / f"{kind}.token"


def _read(file: Path) -> str:
    st = os.stat(file)
    if st.st_mode & 0o077:
        raise RuntimeDirError(f"token file {file} has mode {stat.S_IMODE(st.st_mode):04o}; it must be readable by "
                              f"its owner only: chmod 600 {file}")
    value = file.read_text().strip()
    if not value:
        raise RuntimeDirError(f"token file {file} is empty")
    return value


def read_token(kind: str, override: Optional[str] = None) -> Optional[str]:
    """The token of ``kind``, or None when its file does not exist (yet).  An explicit
    file that is missing is an error: the operator named it."""
    file = token_path(kind, override)
    explicit = bool(override or os.environ.get(_TOKEN_ENV[kind]))
    if not explicit:
        check_before_connect(f"ipc://{file}")
    try:
        return _read(file)
    except FileNotFoundError:
        if explicit:
            raise RuntimeDirError(f"{kind} token file {file} does not exist") from None
        return None


def load_or_create_token(kind: str, override: Optional[str] = None, create_explicit: bool = False) -> str:
    """The token of ``kind``, created (mode 0600, atomically) when it does not exist.

    An explicitly named file (flag or environment) is created only with
    ``create_explicit`` (the broker): a worker given a wrong path must fail, not make up
    a token the broker will never accept."""
    file = token_path(kind, override)
    explicit = bool(override or os.environ.get(_TOKEN_ENV[kind]))
    if not explicit:
        ensure()
    try:
        return _read(file)
    except FileNotFoundError:
        if explicit and not create_explicit:
            raise RuntimeDirError(f"{kind} token file {file} does not exist (copy it from the broker's host)") from None
    tmp = file.with_name(f".{file.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        try:
            os.link(tmp, file)  # fails if another process got there first: then use theirs
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)
    return _read(file)


def token_matches(expected: Optional[str], given) -> bool:
    """Constant-time comparison; nothing matches when no token is configured."""
    if not expected or not isinstance(given, str) or not given:
        return False
    return hmac.compare_digest(expected.encode(), given.encode())
