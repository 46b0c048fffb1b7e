"""``rollpool keys gen DIR``: CURVE certificates for a pool (zmq.auth format).

Writes ``server.key`` / ``server.key_secret`` (the pool's server pair: broker,
publisher and relay bind with it), ``client.key`` / ``client.key_secret`` (a
client pair: workers, relays upstream, trainer clients connect with it) and
``allowed_clients/client.key`` (the public client keys servers accept). More
clients: ``rollpool keys gen DIR --client NAME`` adds ``NAME.key[_secret]`` and
allows it. Secret files are written mode 0600. Point every process at DIR with
``--curve-dir DIR``; ship only what a host needs (a worker host needs
``server.key`` and its own client pair, never ``server.key_secret``).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil

from rollpool.protocol.sockets import (
    ALLOWED_CLIENTS_DIR,
    CLIENT_PUBLIC_FILE,
    SERVER_PUBLIC_FILE,
    SERVER_SECRET_FILE,
)

__all__ = ["HELP", "add_arguments", "run", "generate"]

HELP = "generate CURVE certificates (server pair, client pairs, allowed-clients directory)"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", metavar="ACTION")
    gen = sub.add_parser("gen", help="write certificates into DIR")
    gen.add_argument("dir", help="directory to write (created if missing)")
    gen.add_argument("--client", action="append", default=None, help="client pair name (repeatable; default: client)")
    gen.add_argument("--force", action="store_true", help="overwrite an existing server pair")


def generate(directory: str, clients: tuple[str, ...] = ("client",), *, force: bool = False) -> dict[str, str]:
    """Write the server pair (unless present) and each client pair; returns the paths written."""
    import zmq.auth

    os.makedirs(directory, exist_ok=True)
    allowed = os.path.join(directory, ALLOWED_CLIENTS_DIR)
    os.makedirs(allowed, exist_ok=True)
    written: dict[str, str] = {}
    if force or not os.path.exists(os.path.join(directory, SERVER_SECRET_FILE)):
        public, secret = zmq.auth.create_certificates(directory, "server")
        os.chmod(secret, 0o600)
        written["server_public"], written["server_secret"] = public, secret
    for name in clients:
        public, secret = zmq.auth.create_certificates(directory, name)
        os.chmod(secret, 0o600)
        shutil.copy(public, os.path.join(allowed, os.path.basename(public)))
        written[f"{name}_public"], written[f"{name}_secret"] = public, secret
    assert os.path.exists(os.path.join(directory, SERVER_PUBLIC_FILE))
    return written


def run(args: argparse.Namespace) -> int:
    if getattr(args, "keys_command", None) != "gen":
        print("usage: rollpool keys gen DIR [--client NAME ...]")
        return 2
    clients = tuple(args.client or (CLIENT_PUBLIC_FILE.removesuffix(".key"),))
    written = generate(args.dir, clients, force=args.force)
    for what, path in written.items():
        print(f"{what}: {path}")
    return 0
