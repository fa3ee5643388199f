"""ZeroMQ helpers: the one place sockets are bound, connected and secured (ARCHITECTURE.md, Trust). The ZAP allow-list
is needed because libzmq alone admits any key pair that knows the server's public key; the run secret because any
local process can reach a loopback port."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import socket as _socket
import stat
from types import SimpleNamespace
from typing import NamedTuple

import zmq
from zmq.utils import z85

SECRET_FILE = "secret"
SECRET_HEX_CHARS = 64  # 32 random bytes


class InsecureBindError(RuntimeError):
    """Traffic on the network without CURVE authentication."""


class Curve(NamedTuple):
    server_public: bytes
    server_secret: bytes = b""  # server side only
    client_public: bytes = b""  # client side only
    client_secret: bytes = b""


def make_curve_keys() -> tuple[str, str]:
    pub, sec = zmq.curve_keypair()
    return pub.decode(), sec.decode()


def curve_from_config(net) -> Curve | None:
    """A NetSection's CURVE keys, None without server keys (a client's public key is derived from its secret)."""
    if not net.curve_server_public:
        return None
    secret = net.curve_client_secret.encode()
    return Curve(net.curve_server_public.encode(), net.curve_server_secret.encode(),
                 zmq.curve_public(secret) if secret else b"", secret)


def client_keys(net) -> list[str]:
    keys = net.curve_client_public
    return ([keys] if keys else []) if isinstance(keys, str) else list(keys)


def serve_curve(ctx: zmq.Context, net):
    """``(curve, authenticator)``: the keys to bind with and a running ZAP handler admitting only
    :func:`client_keys` (stop it when the sockets close); ``(None, None)`` without CURVE keys."""
    curve = curve_from_config(net)
    if curve is None:
        return None, None
    allowed = {k.encode() for k in client_keys(net)}
    if not allowed:
        raise InsecureBindError("CURVE without a client allow-list (net.curve_client_public) would "
                                "admit any key pair")
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    allow = SimpleNamespace(callback=lambda _domain, key: key in allowed)
    auth.configure_curve_callback("*", credentials_provider=allow)
    return curve, auth


def check_host(host: str) -> None:
    """ValueError unless ``host`` is ``localhost`` or an IPv4 address (``127.evil`` fails here)."""
    if host != "localhost":
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv4 address or localhost") from None


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.IPv4Address(host).is_loopback
    except ValueError:
        return False


def check_curve_key(key: str) -> None:
    try:
        ok = len(key) == 40 and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError("not a z85 CURVE key of 40 characters (make one with core.net.make_curve_keys())")


def create_run_secret(run_dir: str) -> str:
    """``run_dir/secret`` if it exists (a resume keeps it), else a new one, created exclusively with
    mode 0600 so that no other process can have created or read it first."""
    path, flags = os.path.join(run_dir, SECRET_FILE), os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW
    with contextlib.suppress(FileExistsError), open(os.open(path, flags, 0o600), "w") as f:
        f.write(secrets.token_hex(SECRET_HEX_CHARS // 2))
        f.flush()
        os.fsync(f.fileno())
    return run_secret(run_dir)


def run_secret(run_dir: str) -> str:
    """``run_dir/secret``; RuntimeError unless a regular 0600 file of this user holding a valid secret."""
    path = os.path.join(run_dir, SECRET_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise RuntimeError(f"no run secret at {path}: the launcher creates it (core.net.create_run_secret)") from None
    except OSError as e:  # a symlink (ELOOP) or unreadable
        raise RuntimeError(f"cannot open the run secret {path}: {e.strerror}") from None
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RuntimeError(f"the run secret {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise RuntimeError(f"the run secret {path} belongs to uid {st.st_uid}, not to this user "
                               f"({os.geteuid()}): refusing it")
        if st.st_mode & 0o077:
            raise RuntimeError(f"the run secret {path} has mode {stat.S_IMODE(st.st_mode):04o}: "
                               "group/other may read or change it; it must be 0600")
        token = f.read(SECRET_HEX_CHARS + 1).decode("ascii", "replace")
    if len(token) != SECRET_HEX_CHARS or any(ch not in "0123456789abcdef" for ch in token):
        raise RuntimeError(f"the run secret {path} is damaged (want {SECRET_HEX_CHARS} hex characters)")
    return token


def free_port(host: str = "127.0.0.1") -> int:
    """A free port for a server on ``host`` (on every interface's when it is not loopback)."""
    with _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM) as s:
        s.bind((host if is_loopback(host) else "0.0.0.0", 0))
        return s.getsockname()[1]


def bind(sock: zmq.Socket, host: str, port: int = 0, curve: Curve | None = None) -> int:
    """Bind ``sock`` on ``host:port`` (0 = any free port); the bound port."""
    check_host(host)
    if curve is not None:
        if not curve.server_secret:
            raise InsecureBindError("CURVE server needs its secret key")
        sock.curve_server = True
        sock.curve_publickey = curve.server_public
        sock.curve_secretkey = curve.server_secret
    elif not is_loopback(host):
        raise InsecureBindError(f"refusing to bind {host}: off loopback, ZeroMQ CURVE keys are required "
                                "(net.curve_server_public/secret; make them with core.net.make_curve_keys())")
    if port:
        sock.bind(f"tcp://{host}:{port}")
        return port
    return sock.bind_to_random_port(f"tcp://{host}")


def connect(sock: zmq.Socket, host: str, port: int, curve: Curve | None = None) -> None:
    if curve is not None:
        if not (curve.client_public and curve.client_secret):
            raise InsecureBindError("CURVE client needs its own key pair")
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.client_public
        sock.curve_secretkey = curve.client_secret
    sock.connect(f"tcp://{host}:{port}")


def socket(ctx: zmq.Context, kind: int, *, linger_ms: int = 0, max_msg: int = -1):
    s = ctx.socket(kind)
    s.linger = linger_ms
    if max_msg > 0:  # a larger frame closes the peer's connection instead of being allocated
        s.setsockopt(zmq.MAXMSGSIZE, max_msg)
    return s


ZERO_COPY_BYTES = 64 << 10  # below this, pyzmq's zero-copy bookkeeping costs more than a copy
_MORE, _LAST = int(zmq.NOBLOCK | zmq.SNDMORE), int(zmq.NOBLOCK)  # plain ints: enum flags cost ~1 us a frame


def send_frames(sock: zmq.Socket, frames: list) -> None:
    """One message, never blocking (raises zmq.Again / ZMQError as ``send`` does); large frames zero-copy."""
    last = len(frames) - 1
    for i, f in enumerate(frames):
        sock.send(f, _MORE if i < last else _LAST, copy=len(f) < ZERO_COPY_BYTES)
