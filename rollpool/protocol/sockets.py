"""The one place every rollpool socket is made.

`SocketFactory` applies the options DESIGN.md requires of every socket: ROUTER
sockets set ROUTER_MANDATORY (sending to a vanished peer raises instead of
silently dropping) and a send timeout; control sockets cap MAXMSGSIZE; every
socket closes with linger 0; high-water marks bound per-peer buffers; TCP
keepalive and ZMTP heartbeats close half-open connections (a peer that
vanished without a FIN) instead of keeping their state forever. When a
`SecurityConfig` is given, CURVE encryption and ZAP authentication switch on
for every socket the factory makes; clients pin the server's public key.

Roles (`rollpool.protocol.roles`): a server socket is made with the name it
has in `SERVER_SOCKETS` (``serves="broker.client"``); that name is its ZAP
domain, and the ZAP handler admits only keys of the roles the table lists for
it. Refusals are counted by role and socket (`counters()`). The allowed keys
are read again by `reload_keys()` (the CLIs call it on SIGHUP), so keys are
added and revoked without a restart. A key directory from before roles (one
``allowed_clients/`` set) still works, admitting every key on every socket,
with a warning naming ``rollpool keys migrate``.

`watch(sock, name)` counts a server socket's disconnects with a socket
monitor: libzmq drops a message over MAXMSGSIZE together with its connection
and reports nothing else, so a rising ``disconnects.NAME`` next to steady
sessions is how an oversize sender shows up on the receiving side.

pyzmq is imported lazily so that ``import rollpool.protocol`` stays free of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from rollpool.protocol.errors import ConfigError
from rollpool.protocol.roles import ROLES, SERVER_SOCKETS, KeyLayout

log = logging.getLogger(__name__)

__all__ = ["SocketOptions", "SecurityConfig", "SocketFactory", "send_now"]

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
    tcp_keepalive_idle_s: int = 60
    """Seconds a TCP connection may be idle before the kernel probes it."""
    tcp_keepalive_interval_s: int = 10
    tcp_keepalive_count: int = 6
    """Unanswered probes before the kernel drops the connection (idle + interval x count: ~2 min)."""
    heartbeat_interval_ms: int = 10_000
    """ZMTP PING interval (0: off); a peer that does not answer within `heartbeat_timeout_ms` is dropped."""
    heartbeat_timeout_ms: int = 30_000
    handshake_timeout_ms: int = 10_000
    monitor_disconnects: bool = True
    """Count disconnects and failed handshakes of watched server sockets (a libzmq socket monitor). It was
    off by default for a while: the monitor thread spun, holding the GIL, once every socket it watched had
    closed (an empty zmq Poller returns at once), so each broker whose factory nobody closed left a spinning
    thread behind; the broker's in-process tests ran 25x slower and lost 0.05 s-heartbeat workers. The thread
    now leaves when nothing is watched (and `watch` starts another)."""

    def __post_init__(self) -> None:
        for name in (
            "send_timeout_ms", "max_msg_bytes", "send_hwm", "recv_hwm", "handshake_timeout_ms",
            "tcp_keepalive_idle_s", "tcp_keepalive_interval_s", "tcp_keepalive_count", "heartbeat_timeout_ms",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"SocketOptions.{name} must be >= 1, got {getattr(self, name)}")
        if self.linger_ms < 0:
            raise ConfigError(f"SocketOptions.linger_ms must be >= 0, got {self.linger_ms}")
        if self.heartbeat_interval_ms < 0:
            raise ConfigError(f"SocketOptions.heartbeat_interval_ms must be >= 0, got {self.heartbeat_interval_ms}")


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """CURVE keys (files written by ``rollpool keys gen``).

    A process that binds needs `server_key_file` (the pool's server secret
    certificate) and `allowed_clients_dir`; a process that connects needs
    `client_key_file` (its own secret certificate) and `server_public_file`.
    """

    server_key_file: str | None = None
    allowed_clients_dir: str | None = None
    """Pre-roles: one set of public keys that every server socket admits."""
    client_key_file: str | None = None
    server_public_file: str | None = None
    allowed_roles_dir: str | None = None
    """Roles: a directory with one subdirectory of public keys per role (``allowed/worker/*.key``, ...)."""
    role: str | None = None
    """The role this process connects as (which pair `from_dir` picked); informational."""

    @property
    def enabled(self) -> bool:
        return any((self.server_key_file, self.allowed_clients_dir, self.client_key_file, self.server_public_file, self.allowed_roles_dir))

    @classmethod
    def from_dir(cls, curve_dir: str | None, role: str | None = None) -> SecurityConfig | None:
        """The paths inside a directory written by ``rollpool keys gen DIR`` (None: CURVE off).

        `role` (``trainer``, ``worker``, ``relay``) picks the pair this process
        connects with; without it, the only role pair present is used (a host
        ships only its own), else the pre-roles ``client.key_secret``. Binding
        sockets use ``server.key_secret`` and ``allowed/ROLE/`` (or, in a
        directory from before roles, ``allowed_clients/`` for everyone). A
        process that both binds and connects (relay, trainer client hosting a
        publisher) uses both halves.
        """
        if not curve_dir:
            return None
        import os

        if not os.path.isdir(curve_dir):
            raise ConfigError(f"CURVE: {curve_dir!r} is not a directory (make one with `rollpool keys gen DIR`)")
        layout = KeyLayout(curve_dir)
        try:
            client_secret = layout.client_secret_for(role)
        except ValueError as exc:
            raise ConfigError(f"CURVE: {exc}") from None
        return cls(
            server_key_file=layout.server_secret,
            allowed_clients_dir=None if layout.has_roles else layout.legacy_allowed,
            client_key_file=client_secret,
            server_public_file=layout.server_public,
            allowed_roles_dir=layout.allowed_root if layout.has_roles else None,
            role=role,
        )


class _Keyring:
    """The allowed public keys by role, read from disk; the ZAP handler's credentials provider.

    `callback` runs on the authenticator's thread: it reads one dict that
    `load` replaces whole (no lock needed under the GIL) and bumps counters.
    """

    def __init__(self, security: SecurityConfig) -> None:
        self.security = security
        self.legacy = security.allowed_roles_dir is None
        self._keys: dict[bytes, frozenset[str]] = {}
        self.refusals: dict[str, int] = {}
        self.admitted = 0
        self._last_log: dict[str, float] = {}

    def load(self) -> int:
        import os

        import zmq.auth

        sec = self.security
        keys: dict[bytes, set[str]] = {}
        roles_dir = sec.allowed_roles_dir
        if roles_dir is None and sec.allowed_clients_dir is not None:
            # a pre-roles directory migrated while this process runs: its allowed/ wins from the next reload
            sibling = os.path.join(os.path.dirname(os.path.abspath(sec.allowed_clients_dir)), KeyLayout.allowed_name)
            roles_dir = sibling if os.path.isdir(sibling) else None
        self.legacy = roles_dir is None
        if roles_dir is not None:
            if not os.path.isdir(roles_dir):
                raise ConfigError(f"CURVE: {roles_dir} is not a directory")
            for role in ROLES:
                d = os.path.join(roles_dir, role)
                if os.path.isdir(d):
                    for key in zmq.auth.load_certificates(d):
                        keys.setdefault(key, set()).add(role)
        elif sec.allowed_clients_dir is not None:
            if not os.path.isdir(sec.allowed_clients_dir):
                raise ConfigError(f"CURVE: {sec.allowed_clients_dir} is not a directory")
            for key in zmq.auth.load_certificates(sec.allowed_clients_dir):
                keys[key] = set(ROLES)
        self._keys = {k: frozenset(v) for k, v in keys.items()}
        return len(self._keys)

    def callback(self, domain: str, client_key: bytes) -> bool:
        roles = self._keys.get(client_key)
        if domain in SERVER_SOCKETS:
            admits: tuple[str, ...] = SERVER_SOCKETS[domain].admits
        else:  # a socket made without a role-table name: only possible with pre-roles keys
            admits = ROLES if self.legacy else ()
        if roles is not None and any(r in admits for r in roles):
            self.admitted += 1
            return True
        who = "unknown" if roles is None else "+".join(sorted(roles))
        name = f"{who}@{domain}"
        self.refusals[name] = self.refusals.get(name, 0) + 1
        now = time.monotonic()
        if now - self._last_log.get(name, -1e9) >= 60.0:
            self._last_log[name] = now
            log.warning("CURVE: refused a %s key on %s (admits %s)", who, domain, ", ".join(admits) or "nobody")
        return False


class _Monitor:
    """One thread that reads the monitor sockets of watched server sockets and counts their events.

    The thread waits on them without a timeout (an idle process then has no thread waking ten times a second: about a
    millisecond of CPU a second on a 2-core box, most of an idle broker's), and a pipe of its own wakes it when a socket
    is watched or the monitor is closed. It leaves once every watched socket is closed; `watch` starts it again."""

    def __init__(self, context: Any) -> None:
        import zmq

        self._ctx: Any = zmq.Context.shadow(context.underlying)
        self._pairs: dict[Any, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counts: dict[str, int] = {}
        self._n = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a full pipe already wakes the thread: a write never waits
        self._fds = weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"w")

    def watch(self, sock: Any, name: str) -> None:
        import zmq

        with self._lock:
            self._n += 1
            addr = f"inproc://rollpool-monitor-{id(self)}-{self._n}"
            sock.monitor(
                addr,
                zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_MONITOR_STOPPED,
            )
            pair = self._ctx.socket(zmq.PAIR)
            pair.setsockopt(zmq.LINGER, 0)
            pair.connect(addr)
            self._pairs[pair] = name
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="rollpool-socket-monitor", daemon=True)
                self._thread.start()
            else:
                self._wake()  # the running thread waits on the sockets it knows: it registers this one

    def _run(self) -> None:
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        names = {
            int(zmq.EVENT_DISCONNECTED): "disconnects",
            int(zmq.EVENT_HANDSHAKE_FAILED_AUTH): "handshake_refused",
            int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL): "handshake_failed",
        }
        stopped = int(zmq.EVENT_MONITOR_STOPPED)
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        seen: set[Any] = set()
        try:
            while not self._stop.is_set():
                with self._lock:
                    if not self._pairs:
                        # every watched socket is closed: leave (`watch` starts a new thread when one is needed again)
                        self._thread = None
                        return
                    for pair in self._pairs:
                        if pair not in seen:
                            poller.register(pair, zmq.POLLIN)
                            seen.add(pair)
                ready = poller.poll()  # until an event or a wake-up (`watch`, `close`)
                for pair, _ in ready:
                    if pair == self._wake_r:
                        with contextlib.suppress(BlockingIOError, OSError):
                            os.read(self._wake_r, 4096)
                        continue
                    event = parse_monitor_message(pair.recv_multipart(zmq.NOBLOCK))
                    if int(event["event"]) == stopped:  # the watched socket was closed
                        poller.unregister(pair)
                        seen.discard(pair)
                        with self._lock:
                            self._pairs.pop(pair, None)
                        pair.close(linger=0)
                        continue
                    kind = names.get(int(event["event"]))
                    if kind is not None:
                        key = f"{kind}.{self._pairs.get(pair, '?')}"
                        self.counts[key] = self.counts.get(key, 0) + 1
        except (zmq.ZMQError, ValueError):
            pass  # the context is terminating
        finally:
            with self._lock:
                if self._thread is threading.current_thread():  # not when it left because nothing is watched
                    for pair in self._pairs:
                        pair.close(linger=0)
                    self._pairs.clear()
                    self._thread = None

    def close(self) -> None:
        self._stop.set()
        self._wake()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=2)


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class SocketFactory:
    """Makes sockets on one ZeroMQ context (sync or asyncio) with rollpool's options."""

    def __init__(self, context: Any, options: SocketOptions | None = None, security: SecurityConfig | None = None) -> None:
        self.context = context
        self.options = options or SocketOptions()
        self.security = security if security is not None and security.enabled else None
        self._authenticator: Any = None
        self._keyring: _Keyring | None = None
        self._monitor: _Monitor | None = None
        self._server_keys: tuple[bytes, bytes] | None = None
        self._client_keys: tuple[bytes, bytes] | None = None
        self._server_public: bytes | None = None

    # -- socket kinds

    def router(self, bind: str | None = None, *, max_msg_bytes: int | None = None, serves: str | None = None) -> Any:
        """A ROUTER; `serves` names it in `roles.SERVER_SOCKETS` (required once keys have roles)."""
        import zmq

        sock = self._make(zmq.ROUTER, server=True, max_msg_bytes=max_msg_bytes, serves=serves)
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

    def pub(self, bind: str | None = None, *, serves: str | None = None) -> Any:
        import zmq

        sock = self._make(zmq.PUB, server=True, max_msg_bytes=None, serves=serves)
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
        """Stop the ZAP authenticator and the monitor thread, if started (sockets are closed by their owners)."""
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None

    # -- roles, reload, counters

    def reload_keys(self) -> int:
        """Read the allowed keys again (SIGHUP); returns how many keys are now admitted somewhere.

        New sessions see the new set at once; a session already established is
        not cut (ZAP runs at the handshake), so revoking a key takes effect on
        that peer's next connection: restart or firewall it to end it now.
        """
        if self._keyring is None:
            return 0
        n = self._keyring.load()
        log.info("CURVE: allowed keys reloaded (%d keys)", n)
        return n

    def watch(self, sock: Any, name: str) -> None:
        """Count `sock`'s disconnects and failed handshakes under `name` (see the module docstring).

        A no-op unless `SocketOptions.monitor_disconnects` is set.
        """
        if not self.options.monitor_disconnects:
            return
        if self._monitor is None:
            self._monitor = _Monitor(self.context)
        self._monitor.watch(sock, name)

    def counters(self) -> dict[str, int]:
        """Flat counters: ``refused.role.WHO@SOCKET`` (CURVE refusals) and the watched sockets' events."""
        out: dict[str, int] = {}
        if self._keyring is not None:
            for name, n in self._keyring.refusals.items():
                out[f"refused.role.{name}"] = n
        if self._monitor is not None:
            out.update(self._monitor.counts)
        return out

    # -- internals

    def _make(self, kind: int, *, server: bool, max_msg_bytes: int | None, serves: str | None = None) -> Any:
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
            sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, o.tcp_keepalive_idle_s)
            sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, o.tcp_keepalive_interval_s)
            sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, o.tcp_keepalive_count)
        if o.heartbeat_interval_ms:
            sock.setsockopt(zmq.HEARTBEAT_IVL, o.heartbeat_interval_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, o.heartbeat_timeout_ms)
        if serves is not None and serves not in SERVER_SOCKETS:
            raise ConfigError(f"unknown server socket {serves!r} (known: {', '.join(SERVER_SOCKETS)})")
        if self.security is not None:
            self._apply_curve(sock, server=server, serves=serves)
        return sock

    def _apply_curve(self, sock: Any, *, server: bool, serves: str | None = None) -> None:
        import zmq
        import zmq.auth

        sec = self.security
        assert sec is not None
        if server:
            if not sec.server_key_file or not (sec.allowed_clients_dir or sec.allowed_roles_dir):
                raise ConfigError("CURVE: a binding socket needs server_key_file and allowed_roles_dir (or allowed_clients_dir)")
            if serves is None and sec.allowed_roles_dir is not None:
                raise ConfigError("CURVE with roles: a binding socket needs serves=<name in roles.SERVER_SOCKETS>")
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
                keyring = _Keyring(sec)
                keyring.load()
                if keyring.legacy:
                    log.warning(
                        "CURVE: %s holds one key set for every role: any allowed key may use any socket "
                        "(run `rollpool keys migrate DIR` to give trainers, workers and relays their own keys)",
                        sec.allowed_clients_dir,
                    )
                auth = ThreadAuthenticator(zap_ctx)
                auth.start()
                for domain in (*SERVER_SOCKETS, "*"):
                    auth.configure_curve_callback(domain=domain, credentials_provider=keyring)
                self._keyring = keyring
                self._authenticator = auth
            sock.curve_publickey, sock.curve_secretkey = self._server_keys
            sock.zap_domain = (serves or "*").encode()
            sock.curve_server = True
        else:
            if not sec.client_key_file or not sec.server_public_file:
                raise ConfigError("CURVE: a connecting socket needs client_key_file and server_public_file")
            if self._client_keys is None:
                import os

                if not os.path.exists(sec.client_key_file):
                    raise ConfigError(
                        f"CURVE: {sec.client_key_file} does not exist (give the process its role, "
                        "e.g. SecurityConfig.from_dir(DIR, role='worker'), and ship that role's key pair)"
                    )
                public, secret = zmq.auth.load_certificate(sec.client_key_file)
                if secret is None:
                    raise ConfigError(f"CURVE: {sec.client_key_file} holds no secret key")
                self._client_keys = (public, secret)
                self._server_public, _ = zmq.auth.load_certificate(sec.server_public_file)
            sock.curve_publickey, sock.curve_secretkey = self._client_keys
            sock.curve_serverkey = self._server_public


def send_now(sock: Any, frames: list[Any], **kwargs: Any) -> BaseException | None:
    """Send without waiting on a sync or asyncio socket; the error, if the send failed.

    With DONTWAIT an asyncio socket resolves its future at once (it never
    has a pending send, since every send here is DONTWAIT); the error is read
    off the future so that it is never left unretrieved.
    """
    import zmq

    try:
        result = sock.send_multipart(frames, **kwargs)
    except zmq.ZMQError as exc:
        return exc
    if isinstance(result, asyncio.Future):
        if not result.done():  # cannot happen with DONTWAIT; never leave it dangling
            result.cancel()
            return zmq.Again()
        return result.exception()
    return None
