"""ZeroMQ helpers: the one place sockets are bound, connected and secured.

Policy: bind 127.0.0.1 unless configured otherwise; binding any non-loopback address requires
ZeroMQ CURVE server keys and is refused without them. Clients of a CURVE server must present a
key pair and the server's public key; an unauthenticated client never completes the handshake.
"""

from __future__ import annotations

import ipaddress
import socket as _socket
from dataclasses import dataclass

import zmq


class InsecureBindError(RuntimeError):
    """A bind or connect that would put traffic on the network without CURVE authentication."""


@dataclass(frozen=True)
class Curve:
    server_public: bytes
    server_secret: bytes = b""  # server side only
    client_public: bytes = b""  # client side only
    client_secret: bytes = b""


def make_curve_keys() -> tuple[str, str]:
    """A fresh (public, secret) z85 key pair."""
    pub, sec = zmq.curve_keypair()
    return pub.decode(), sec.decode()


def curve_from_config(net) -> Curve | None:
    if not net.curve_server_public:
        return None
    return Curve(
        server_public=net.curve_server_public.encode(),
        server_secret=net.curve_server_secret.encode(),
        client_public=net.curve_client_public.encode(),
        client_secret=net.curve_client_secret.encode(),
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bind(sock: zmq.Socket, host: str, port: int = 0, curve: Curve | None = None) -> int:
    """Bind ``sock`` on ``host:port`` (0 = any free port); returns the bound port."""
    if curve is not None:
        if not curve.server_secret:
            raise InsecureBindError("CURVE server needs its secret key")
        sock.curve_server = True
        sock.curve_publickey = curve.server_public
        sock.curve_secretkey = curve.server_secret
    elif not is_loopback(host):
        raise InsecureBindError(
            f"refusing to bind {host}: a non-loopback bind requires ZeroMQ CURVE keys "
            "(net.curve_server_public / net.curve_server_secret; make them with "
            "core.net.make_curve_keys())"
        )
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


def socket(ctx: zmq.Context, kind: int, *, linger_ms: int = 0, max_msg: int = -1, hwm: int = 0):
    s = ctx.socket(kind)
    s.linger = linger_ms
    if max_msg > 0:
        # frames over this size close the peer's connection instead of being allocated
        s.setsockopt(zmq.MAXMSGSIZE, max_msg)
    if hwm:
        s.sndhwm = hwm
        s.rcvhwm = hwm
    return s
