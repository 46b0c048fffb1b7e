"""Roles: who may connect to which server socket, and which message types each socket serves.

A CURVE key belongs to one role (`TRAINER`, `WORKER`, `RELAY`); `rollpool
keys gen` writes one key set per role and an allowed-keys directory per role.
Every server socket has a name in `SERVER_SOCKETS`: the roles it admits (the
ZAP handler refuses every other key at the handshake) and the message types it
serves (the codec refuses any other type before decoding its fields). The table
is the single statement of the policy; the socket factory, the broker, the
weight servers and the role-matrix test all read it.

Without CURVE (plaintext, loopback) roles cannot be told apart, but the type
table still holds per socket. With a key directory from before roles (one
``allowed_clients/`` set), every socket admits every key and a warning says so
until ``rollpool keys migrate`` is run.

Key layout (`KeyLayout`), all under one directory::

    server.key  server.key_secret                  the pool's server pair (broker, publisher, relays bind)
    trainer.key trainer.key_secret                 a trainer host's pair
    worker.key  worker.key_secret                  a worker host's pair
    relay.key   relay.key_secret                   a relay host's pair
    allowed/trainer/*.key  allowed/worker/*.key  allowed/relay/*.key    public keys admitted per role

Pure: stdlib only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "TRAINER",
    "WORKER",
    "RELAY",
    "ROLES",
    "ServerSocket",
    "SERVER_SOCKETS",
    "server_socket",
    "KeyLayout",
    "HOST_FILES",
]

TRAINER = "trainer"
WORKER = "worker"
RELAY = "relay"
ROLES: tuple[str, ...] = (TRAINER, WORKER, RELAY)


@dataclass(frozen=True, slots=True)
class ServerSocket:
    name: str
    """The ZAP domain of the socket, and its name in refusal counters."""
    admits: tuple[str, ...]
    """Roles whose keys complete a CURVE handshake with it."""
    accepts: frozenset[str]
    """Message types it serves (a PUB socket serves none: it only sends)."""


_WORKER_PORT = frozenset(
    {"hello", "credit", "result", "result_batch", "worker_heartbeat", "nack", "goodbye", "control_reply", "apply_request", "apply_done",
     "turn_records", "turn_record_batch"}
)
_CLIENT_PORT = frozenset(
    {"client_hello", "submit", "pull", "ack", "set_version", "status_request", "control", "cancel_prompts"}
)
_WEIGHTS = frozenset({"manifest_request", "fetch"})

SERVER_SOCKETS: dict[str, ServerSocket] = {
    s.name: s
    for s in (
        ServerSocket("broker.worker", (WORKER,), _WORKER_PORT),
        ServerSocket("broker.client", (TRAINER,), _CLIENT_PORT),
        ServerSocket("publisher.router", (WORKER, RELAY), _WEIGHTS),
        ServerSocket("publisher.pub", (WORKER, RELAY), frozenset()),
        # relays may chain (a node relay fetching from a rack relay), so relays admit relays
        ServerSocket("relay.router", (WORKER, RELAY), _WEIGHTS),
        ServerSocket("relay.pub", (WORKER, RELAY), frozenset()),
    )
}


def server_socket(name: str) -> ServerSocket:
    try:
        return SERVER_SOCKETS[name]
    except KeyError:
        raise KeyError(f"unknown server socket {name!r} (known: {', '.join(SERVER_SOCKETS)})") from None


HOST_FILES: dict[str, tuple[str, ...]] = {
    "broker": ("server.key", "server.key_secret", "allowed/trainer/", "allowed/worker/"),
    TRAINER: ("server.key", "server.key_secret", "trainer.key", "trainer.key_secret", "allowed/worker/", "allowed/relay/"),
    WORKER: ("server.key", "worker.key", "worker.key_secret"),
    RELAY: ("server.key", "server.key_secret", "relay.key", "relay.key_secret", "allowed/worker/", "allowed/relay/"),
}
"""What each kind of host needs from the key directory (the trainer hosts the weight publisher,
so it binds with the server pair and admits workers and relays)."""


@dataclass(frozen=True, slots=True)
class KeyLayout:
    """Paths inside a key directory written by ``rollpool keys gen``."""

    root: str

    server_public_name = "server.key"
    server_secret_name = "server.key_secret"
    legacy_client_name = "client"
    legacy_allowed_name = "allowed_clients"
    allowed_name = "allowed"

    @property
    def server_public(self) -> str:
        return os.path.join(self.root, self.server_public_name)

    @property
    def server_secret(self) -> str:
        return os.path.join(self.root, self.server_secret_name)

    @property
    def allowed_root(self) -> str:
        return os.path.join(self.root, self.allowed_name)

    @property
    def legacy_allowed(self) -> str:
        return os.path.join(self.root, self.legacy_allowed_name)

    def allowed(self, role: str) -> str:
        return os.path.join(self.allowed_root, role)

    def public(self, name: str) -> str:
        return os.path.join(self.root, f"{name}.key")

    def secret(self, name: str) -> str:
        return os.path.join(self.root, f"{name}.key_secret")

    @property
    def has_roles(self) -> bool:
        return os.path.isdir(self.allowed_root)

    def client_secret_for(self, role: str | None) -> str:
        """The secret a process of `role` connects with: its role's pair, else the pre-roles client pair.

        With no role given, the one role pair present is used (a host ships only its own), else the
        legacy ``client.key_secret``.
        """
        if role is not None:
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r} (roles: {', '.join(ROLES)})")
            if os.path.exists(self.secret(role)):
                return self.secret(role)
            return self.secret(self.legacy_client_name)
        present = [r for r in ROLES if os.path.exists(self.secret(r))]
        if len(present) == 1:
            return self.secret(present[0])
        return self.secret(self.legacy_client_name)
