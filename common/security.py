"""CURVE encryption and authentication for the broker's ZeroMQ endpoints (zmq.auth).

By default the broker listens on Unix sockets in the private runtime directory
(common/config.py, common/runtime_dir.py); CURVE is for endpoints that have to cross
hosts, and the broker refuses to listen beyond loopback without it
(``refuse_plaintext_beyond_host``).

* The broker holds a server certificate (``--curve-secret-file``).  Every peer
  (gateway, worker, script) must know its public key (``--curve-server-key``, the Z85
  string or the public ``.key`` file) and then talks to it encrypted.
* With ``--curve-authorized-keys DIR`` the broker also authenticates peers: only those
  whose public certificate lies in DIR complete the handshake (ZAP, answered by
  zmq.auth's authenticator thread).  Any other peer never gets connected, so nothing
  it sends is ever delivered.  A peer proves its identity with its own certificate
  (``--curve-client-key-file``); without one it uses a throwaway key pair, which is
  enough for encryption only.

Key files are zmq.auth certificates: ``NAME.key`` (public) and ``NAME.key_secret``::

    tokserve curve-keys DIR --name broker        # (python -m common.cli curve-keys ...)
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

Z85_KEY_LEN = 40  # a 32-byte CURVE key in Z85


@dataclass(frozen=True)
class CurveKeys:
    public: bytes
    secret: bytes


def generate(directory: Union[str, Path], name: str) -> tuple[Path, Path]:
    """Create ``directory/name.key`` and ``directory/name.key_secret``; returns both paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def load_keypair(path: Union[str, Path]) -> CurveKeys:
    """Public and secret key from a ``.key_secret`` certificate; ValueError if it has no secret key."""
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read CURVE certificate {path}: {exc}") from None
    if not secret:
        raise ValueError(f"{path} holds no secret key (use the .key_secret file)")
    return CurveKeys(public, secret)


def load_public_key(key_or_path: Union[str, bytes]) -> bytes:
    """A public key given as its 40-character Z85 text or as a certificate file."""
    text = key_or_path.decode() if isinstance(key_or_path, bytes) else key_or_path
    if len(text) == Z85_KEY_LEN and not Path(text).exists():
        try:
            zmq.utils.z85.decode(text)
        except (ValueError, KeyError) as exc:
            raise ValueError(f"not a Z85 CURVE key: {text!r}") from exc
        return text.encode()
    try:
        public, _ = zmq.auth.load_certificate(text)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{text!r} is neither a Z85 CURVE key nor a readable certificate: {exc}") from None
    return public


def configure_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (before bind) a CURVE server with the broker's certificate."""
    sock.curve_server = True
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public


def configure_client(sock: zmq.Socket, server_public: bytes, keys: Optional[CurveKeys] = None) -> None:
    """Make ``sock`` (before connect) a CURVE client of the server with ``server_public``.

    ``keys``: this peer's certificate, needed when the server authenticates peers;
    None: a throwaway key pair (encryption only)."""
    if keys is None:
        public, secret = zmq.curve_keypair()
        keys = CurveKeys(public, secret)
    sock.curve_serverkey = server_public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


def start_authenticator(ctx: zmq.Context, authorized_dir: Union[str, Path]) -> ThreadAuthenticator:
    """Accept only CURVE peers whose public certificate is in ``authorized_dir``.

    Must run before the server sockets of ``ctx`` bind; stop() it when they close."""
    directory = Path(authorized_dir)
    if not directory.is_dir():
        raise ValueError(f"authorized keys folder {directory} does not exist")
    if not any(directory.glob("*.key")):
        raise ValueError(f"authorized keys folder {directory} holds no public certificate (*.key)")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(directory))
    return auth


def refuse_plaintext_beyond_host(flag: str, endpoint: str, curve: bool) -> None:
    """ValueError when ``endpoint`` is reachable from other hosts and ``curve`` is off:
    anyone on the network could read prompts and tokens, or talk to the broker."""
    from common.runtime_dir import is_local_endpoint

    if not curve and not is_local_endpoint(endpoint):
        raise ValueError(f"refusing to bind {flag} {endpoint} without encryption: it is reachable from other hosts; "
                         f"pass --curve-secret-file (and --curve-authorized-keys to admit only known peers), or bind "
                         f"ipc:// or a loopback address")


INSECURE_TCP_FRONTEND_FLAG = "--allow-unauthenticated-tcp-frontend"


def refuse_unauthenticated_tcp_frontend(endpoint: str, curve_authorized_keys: bool, allowed: bool) -> None:
    """ValueError for a ``tcp://`` frontend that would admit any peer: ZeroMQ over TCP
    knows nothing of the peer's uid, so even on loopback every local user (uid nobody
    included) could send GENERATE and INFO past the gateway's API key.  CURVE with
    ``--curve-authorized-keys`` admits only listed peers (CURVE alone encrypts, but anyone
    holding the broker's public key gets in); ipc:// in the 0700 runtime directory admits
    only the same user.  ``allowed``: the operator's explicit opt-in to the open door."""
    if endpoint.startswith("tcp://") and not curve_authorized_keys and not allowed:
        raise ValueError(f"refusing a TCP frontend {endpoint} that admits any peer: every local user (and, beyond "
                         f"loopback, every host) could send requests past the gateway's API key; use the default "
                         f"ipc:// frontend, or --curve-secret-file with --curve-authorized-keys, or accept the open "
                         f"door with {INSECURE_TCP_FRONTEND_FLAG}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="tokserve curve-keys",
                                description="create a CURVE certificate: DIR/NAME.key (public) and DIR/NAME.key_secret")
    p.add_argument("directory")
    p.add_argument("--name", default="broker", help="file name stem, e.g. broker, gateway1, worker0")
    args = p.parse_args(argv)
    public, secret = generate(args.directory, args.name)
    print(f"public key file: {public}\nsecret key file: {secret}\npublic key: {load_keypair(secret).public.decode()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
