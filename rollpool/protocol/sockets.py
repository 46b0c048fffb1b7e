"""The one place every rollpool socket is made.

`SocketFactory` applies the options DESIGN.md requires of every socket: ROUTER
sockets set ROUTER_MANDATORY (sending to a vanished peer raises instead of
silently dropping) and a send timeout; control sockets cap MAXMSGSIZE; every
socket closes with linger 0; high-water marks bound per-peer buffers. When a
`SecurityConfig` is given, CURVE encryption and ZAP authentication switch on
for every socket the factory makes: servers accept only the client keys in
`allowed_clients_dir`, clients pin the server's public key.

pyzmq is imported lazily so that ``import rollpool.protocol`` stays free of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollpool.protocol.errors import ConfigError

__all__ = ["SocketOptions", "SecurityConfig", "SocketFactory"]

# the layout `rollpool keys gen DIR` writes and `SecurityConfig.from_dir` reads
SERVER_PUBLIC_FILE = "server.key"
SERVER_SECRET_FILE = "server.key_secret"
CLIENT_PUBLIC_FILE = "client.key"
CLIENT_SECRET_FILE = "client.key_secret"
ALLOWED_CLIENTS_DIR = "allowed_clients"


@dataclass(frozen=True, slots=True)
class SocketOptions:
    send_timeout_ms: int = 5_000
    """How long a send may wait on a full peer queue before failing (zmq.Again)."""
    max_msg_bytes: int = 64 * 1024 * 1024
    """MAXMSGSIZE: the largest inbound message part a socket accepts."""
    send_hwm: int = 10_000
    recv_hwm: int = 10_000
    linger_ms: int = 0
    tcp_keepalive: bool = True
    handshake_timeout_ms: int = 10_000

    def __post_init__(self) -> None:
        for name in ("send_timeout_ms", "max_msg_bytes", "send_hwm", "recv_hwm", "handshake_timeout_ms"):
            if getattr(self, name) < 1:
                raise ConfigError(f"SocketOptions.{name} must be >= 1, got {getattr(self, name)}")
        if self.linger_ms < 0:
            raise ConfigError(f"SocketOptions.linger_ms must be >= 0, got {self.linger_ms}")


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """CURVE keys (files written by ``rollpool keys gen``).

    A process that binds needs `server_key_file` (the pool's server secret
    certificate) and `allowed_clients_dir`; a process that connects needs
    `client_key_file` (its own secret certificate) and `server_public_file`.
    """

    server_key_file: str | None = None
    allowed_clients_dir: str | None = None
    client_key_file: str | None = None
    server_public_file: str | None = None

    @property
    def enabled(self) -> bool:
        return any((self.server_key_file, self.allowed_clients_dir, self.client_key_file, self.server_public_file))

    @classmethod
    def from_dir(cls, curve_dir: str | None) -> SecurityConfig | None:
        """The four paths inside a directory written by ``rollpool keys gen DIR`` (None: CURVE off).

        Layout: ``server.key`` (public), ``server.key_secret``, ``client.key_secret``
        and ``allowed_clients/`` (public client certificates). A process that
        both binds and connects (relay, trainer client hosting a publisher)
        uses both halves.
        """
        if not curve_dir:
            return None
        import os

        if not os.path.isdir(curve_dir):
            raise ConfigError(f"CURVE: {curve_dir!r} is not a directory (make one with `rollpool keys gen DIR`)")
        return cls(
            server_key_file=os.path.join(curve_dir, SERVER_SECRET_FILE),
            allowed_clients_dir=os.path.join(curve_dir, ALLOWED_CLIENTS_DIR),
            client_key_file=os.path.join(curve_dir, CLIENT_SECRET_FILE),
            server_public_file=os.path.join(curve_dir, SERVER_PUBLIC_FILE),
        )


class SocketFactory:
    """Makes sockets on one ZeroMQ context (sync or asyncio) with rollpool's options."""

    def __init__(self, context: Any, options: SocketOptions | None = None, security: SecurityConfig | None = None) -> None:
        self.context = context
        self.options = options or SocketOptions()
        self.security = security if security is not None and security.enabled else None
        self._authenticator: Any = None
        self._server_keys: tuple[bytes, bytes] | None = None
        self._client_keys: tuple[bytes, bytes] | None = None
        self._server_public: bytes | None = None

    # -- socket kinds

    def router(self, bind: str | None = None, *, max_msg_bytes: int | None = None) -> Any:
        import zmq

        sock = self._make(zmq.ROUTER, server=True, max_msg_bytes=max_msg_bytes)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if bind:
            sock.bind(bind)
        return sock

    def dealer(self, connect: str | None = None, *, identity: bytes | None = None, max_msg_bytes: int | None = None) -> Any:
        import zmq

        sock = self._make(zmq.DEALER, server=False, max_msg_bytes=max_msg_bytes)
        if identity:
            sock.setsockopt(zmq.IDENTITY, identity)
        if connect:
            sock.connect(connect)
        return sock

    def pub(self, bind: str | None = None) -> Any:
        import zmq

        sock = self._make(zmq.PUB, server=True, max_msg_bytes=None)
        if bind:
            sock.bind(bind)
        return sock

    def sub(self, connect: str | None = None, topics: tuple[bytes, ...] = (b"",)) -> Any:
        import zmq

        sock = self._make(zmq.SUB, server=False, max_msg_bytes=None)
        for topic in topics:
            sock.setsockopt(zmq.SUBSCRIBE, topic)
        if connect:
            sock.connect(connect)
        return sock

    def close(self) -> None:
        """Stop the ZAP authenticator, if one was started (sockets are closed by their owners)."""
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None

    # -- internals

    def _make(self, kind: int, *, server: bool, max_msg_bytes: int | None) -> Any:
        import zmq

        o = self.options
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, o.linger_ms)
        sock.setsockopt(zmq.SNDTIMEO, o.send_timeout_ms)
        sock.setsockopt(zmq.SNDHWM, o.send_hwm)
        sock.setsockopt(zmq.RCVHWM, o.recv_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes or o.max_msg_bytes)
        sock.setsockopt(zmq.HANDSHAKE_IVL, o.handshake_timeout_ms)
        if o.tcp_keepalive:
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        if self.security is not None:
            self._apply_curve(sock, server=server)
        return sock

    def _apply_curve(self, sock: Any, *, server: bool) -> None:
        import zmq
        import zmq.auth

        sec = self.security
        assert sec is not None
        if server:
            if not sec.server_key_file or not sec.allowed_clients_dir:
                raise ConfigError("CURVE: a binding socket needs server_key_file and allowed_clients_dir")
            if self._server_keys is None:
                public, secret = zmq.auth.load_certificate(sec.server_key_file)
                if secret is None:
                    raise ConfigError(f"CURVE: {sec.server_key_file} holds no secret key")
                self._server_keys = (public, secret)
            if self._authenticator is None:
                from zmq.auth.thread import ThreadAuthenticator

                # The ZAP handler must live in the servers' own context (ZAP is an inproc
                # endpoint of that context); its thread needs blocking sockets, so an
                # asyncio context is shadowed by a plain one over the same C context.
                zap_ctx: zmq.Context[zmq.Socket[Any]] = zmq.Context.shadow(self.context.underlying)
                auth = ThreadAuthenticator(zap_ctx)
                auth.start()
                auth.configure_curve(domain="*", location=sec.allowed_clients_dir)
                self._authenticator = auth
            sock.curve_publickey, sock.curve_secretkey = self._server_keys
            sock.curve_server = True
        else:
            if not sec.client_key_file or not sec.server_public_file:
                raise ConfigError("CURVE: a connecting socket needs client_key_file and server_public_file")
            if self._client_keys is None:
                public, secret = zmq.auth.load_certificate(sec.client_key_file)
                if secret is None:
                    raise ConfigError(f"CURVE: {sec.client_key_file} holds no secret key")
                self._client_keys = (public, secret)
                self._server_public, _ = zmq.auth.load_certificate(sec.server_public_file)
            sock.curve_publickey, sock.curve_secretkey = self._client_keys
            sock.curve_serverkey = self._server_public
