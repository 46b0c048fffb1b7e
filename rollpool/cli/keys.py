"""``rollpool keys``: CURVE certificates for a pool, one key set per role (zmq.auth format).

``rollpool keys gen DIR`` writes the server pair (``server.key`` /
``server.key_secret``: the broker, the trainer's weight publisher and relays
bind with it), one pair per role (``trainer``, ``worker``, ``relay``) and
``allowed/ROLE/`` (the public keys each server socket admits, by the table in
`rollpool.protocol.roles`). ``--add ROLE:NAME`` adds another pair of a role
(``worker-NAME.key[_secret]``, one per host if you like) and allows it.
Secret files are written mode 0600. It prints what each kind of host needs:
ship only that (a worker host gets ``server.key`` and its worker pair, never a
secret of another role or the server secret).

``rollpool keys export DIR HOST DEST`` copies exactly those files for one
kind of host (``broker``, ``trainer``, ``worker``, ``relay``).

``rollpool keys migrate DIR`` turns a directory from before roles (one
``client`` pair, ``allowed_clients/``) into the role layout without a flag
day: the server pair is kept (clients keep pinning the same ``server.key``),
role pairs are added, and the old client keys are allowed in every role for
now, so processes not yet given their role pair keep connecting. Once every
host uses its role pair, ``rollpool keys migrate DIR --finish`` removes the
old keys from ``allowed/`` and retires ``allowed_clients/``; send SIGHUP to the
broker and relays (they reload the allowed keys) and restart the trainer.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil

from rollpool.protocol.roles import HOST_FILES, ROLES, KeyLayout

__all__ = ["HELP", "add_arguments", "run", "generate", "migrate", "finish_migration", "add_key", "export"]

HELP = "CURVE certificates: one key set per role (gen, migrate)"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", metavar="ACTION")
    gen = sub.add_parser("gen", help="write the server pair, one pair per role and allowed/ROLE/ into DIR")
    gen.add_argument("dir", help="directory to write (created if missing)")
    gen.add_argument("--add", action="append", default=None, metavar="ROLE:NAME",
                     help="one more pair of ROLE, written as ROLE-NAME.key[_secret] and allowed (repeatable)")
    gen.add_argument("--force", action="store_true", help="overwrite existing pairs (every peer needs the new keys)")
    exp = sub.add_parser("export", help="copy what one kind of host needs (broker, trainer, worker, relay) into DEST")
    exp.add_argument("dir", help="the key directory `keys gen` wrote")
    exp.add_argument("host", choices=sorted(HOST_FILES), help="the kind of host the copy is for")
    exp.add_argument("dest", help="directory to copy that host's files into")
    mig = sub.add_parser("migrate", help="give a pre-roles key directory (allowed_clients/) per-role keys")
    mig.add_argument("dir", help="the pre-roles key directory (with allowed_clients/)")
    mig.add_argument("--finish", action="store_true", help="stop admitting the pre-roles client keys")


def _pair(layout: KeyLayout, name: str, *, force: bool) -> tuple[str, str] | None:
    import zmq.auth

    if not force and os.path.exists(layout.secret(name)):
        return None
    public, secret = zmq.auth.create_certificates(layout.root, name)
    os.chmod(secret, 0o600)
    return public, secret


def _allow(layout: KeyLayout, role: str, public: str) -> str:
    os.makedirs(layout.allowed(role), exist_ok=True)
    dest = os.path.join(layout.allowed(role), os.path.basename(public))
    shutil.copy(public, dest)
    return dest


def generate(directory: str, extra: tuple[tuple[str, str], ...] = (), *, force: bool = False) -> dict[str, str]:
    """Write the server pair and every role's pair (each unless present) and allow them; returns the paths written."""
    layout = KeyLayout(directory)
    os.makedirs(directory, exist_ok=True)
    written: dict[str, str] = {}
    pair = _pair(layout, "server", force=force)
    if pair is not None:
        written["server_public"], written["server_secret"] = pair
    for role in ROLES:
        os.makedirs(layout.allowed(role), exist_ok=True)
        pair = _pair(layout, role, force=force)
        if pair is not None:
            written[f"{role}_public"], written[f"{role}_secret"] = pair
            written[f"{role}_allowed"] = _allow(layout, role, pair[0])
    for role, name in extra:
        written.update(add_key(directory, role, name, force=force))
    return written


def add_key(directory: str, role: str, name: str, *, force: bool = False) -> dict[str, str]:
    """One more pair of `role` (``ROLE-NAME``), allowed in ``allowed/ROLE/``."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (roles: {', '.join(ROLES)})")
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"bad key name {name!r}")
    layout = KeyLayout(directory)
    pair = _pair(layout, f"{role}-{name}", force=force)
    if pair is None:
        return {}
    return {f"{role}-{name}_public": pair[0], f"{role}-{name}_secret": pair[1], f"{role}-{name}_allowed": _allow(layout, role, pair[0])}


def migrate(directory: str) -> dict[str, str]:
    """Pre-roles -> roles, step 1: role pairs added, old client keys still allowed in every role."""
    import zmq.auth

    layout = KeyLayout(directory)
    if not os.path.isdir(layout.legacy_allowed):
        raise ValueError(f"{directory} has no {layout.legacy_allowed_name}/: nothing to migrate (use `rollpool keys gen`)")
    if not os.path.exists(layout.server_secret):
        raise ValueError(f"{directory} has no server pair")
    written = generate(directory)
    for role in ROLES:
        for cert in sorted(os.listdir(layout.legacy_allowed)):
            path = os.path.join(layout.legacy_allowed, cert)
            if cert.endswith(".key") and os.path.isfile(path):
                zmq.auth.load_certificate(path)  # refuse a file that is not a certificate
                dest = os.path.join(layout.allowed(role), f"legacy-{cert}")
                shutil.copy(path, dest)
                written[f"{role}_legacy_{cert}"] = dest
    return written


def finish_migration(directory: str) -> list[str]:
    """Pre-roles -> roles, step 2: the old client keys are no longer admitted anywhere."""
    layout = KeyLayout(directory)
    removed: list[str] = []
    for role in ROLES:
        d = layout.allowed(role)
        if os.path.isdir(d):
            for cert in sorted(os.listdir(d)):
                if cert.startswith("legacy-"):
                    os.remove(os.path.join(d, cert))
                    removed.append(os.path.join(d, cert))
    if os.path.isdir(layout.legacy_allowed):
        os.replace(layout.legacy_allowed, layout.legacy_allowed + ".retired")
        removed.append(layout.legacy_allowed)
    return removed


def export(directory: str, host: str, dest: str) -> list[str]:
    """Copy only the files `host` needs (`roles.HOST_FILES`) into `dest` (secrets stay mode 0600)."""
    if host not in HOST_FILES:
        raise ValueError(f"unknown host kind {host!r} (one of {', '.join(HOST_FILES)})")
    os.makedirs(dest, exist_ok=True)
    os.chmod(dest, 0o700)
    copied: list[str] = []
    for item in HOST_FILES[host]:
        src = os.path.join(directory, item)
        if item.endswith("/"):
            if not os.path.isdir(src):
                raise ValueError(f"{src} is missing (run `rollpool keys gen {directory}` first)")
            shutil.copytree(src, os.path.join(dest, item), dirs_exist_ok=True)
        else:
            if not os.path.exists(src):
                raise ValueError(f"{src} is missing (run `rollpool keys gen {directory}` first)")
            shutil.copy2(src, os.path.join(dest, item))
        copied.append(os.path.join(dest, item))
    return copied


def _ship_list(directory: str) -> str:
    lines = ["ship to each host only what it needs (from " + directory + "):"]
    for host, files in HOST_FILES.items():
        lines.append(f"  {host + ' host':<13} " + "  ".join(files))
    lines.append("  (a per-host pair from --add ROLE:NAME replaces ROLE.key[_secret] on that host)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    cmd = getattr(args, "keys_command", None)
    try:
        if cmd == "gen":
            extra: list[tuple[str, str]] = []
            for item in args.add or ():
                role, sep, name = item.partition(":")
                if not sep:
                    print(f"--add takes ROLE:NAME, got {item!r}")
                    return 2
                extra.append((role, name))
            written = generate(args.dir, tuple(extra), force=args.force)
            for what, path in written.items():
                print(f"{what}: {path}")
            print(_ship_list(args.dir))
            return 0
        if cmd == "export":
            for path in export(args.dir, args.host, args.dest):
                print(f"copied: {path}")
            return 0
        if cmd == "migrate":
            if args.finish:
                for path in finish_migration(args.dir):
                    print(f"no longer admitted: {path}")
                print("now: SIGHUP the broker and relays (they reload allowed keys); restart the trainer")
                return 0
            for what, path in migrate(args.dir).items():
                print(f"{what}: {path}")
            print("next: give each host its role pair and --curve-dir (old client keys still work meanwhile);")
            print("then: rollpool keys migrate DIR --finish")
            print(_ship_list(args.dir))
            return 0
    except ValueError as exc:
        print(f"rollpool keys: {exc}")
        return 2
    print("usage: rollpool keys gen DIR [--add ROLE:NAME ...] | export DIR HOST DEST | migrate DIR [--finish]")
    return 2
