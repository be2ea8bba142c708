"""The administration commands: set-acl, replication, token (user tokens made here, job
tokens issued and revoked by the leader) and admin (the cluster secret rotated by the
leader)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime

from blobha.cli.blobs import meta_dict
from blobha.cli.connect import client_for
from blobha.cli.output import note, print_json
from blobha.core.acl import format_acl, parse_acl
from blobha.core.errors import InvalidArgument


def cmd_set_acl(args: argparse.Namespace) -> int:
    acl = None if args.acl is None else parse_acl(args.acl)
    with client_for(args) as c:
        if acl is None:
            # Storm's set-acl without -s sets the current ACL again (ADMIN still needed); only
            # if it is still the one read, so a change made meanwhile is never undone.
            current = c.get_meta(args.key)
            meta = c.set_acl(args.key, current.acl, expected_meta_version=current.meta_version)
        else:
            meta = c.set_acl(args.key, acl)
    note(f"ACL of {meta.key} is now {format_acl(meta.acl)}")
    if args.json:
        print_json(meta_dict(meta), indent=2)
    return 0


def cmd_replication(args: argparse.Namespace) -> int:
    with client_for(args) as c:
        if args.read:
            status = c.get_replication(args.key)
            if args.json:
                print_json({"key": status.key, "version": status.version,
                            "replication": status.replication,
                            "replication_factor": status.replication_factor,
                            "holders": list(status.holders)})
            else:
                print(status.replication)
        else:
            meta = c.set_replication_factor(args.key, args.replication_factor)
            note(f"replication factor of {meta.key} is now {meta.replication_factor}")
            if args.json:
                print_json(meta_dict(meta), indent=2)
    return 0


def cmd_admin(args: argparse.Namespace) -> int:
    # One action so far; argparse's choices refuse any other.
    with client_for(args) as c:
        generation, old_secs = c.rotate_cluster_secret()
    note(f"cluster secret rotated (generation {generation}); the masters accept the old one for"
         f" {old_secs:.0f} s more, then refuse it")
    if args.json:
        print_json({"generation": generation, "old_accepted_secs": old_secs})
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    if args.action == "job":
        return _job_token(args)
    if args.action == "revoke":
        with client_for(args) as c:
            token_id = c.revoke_job_token(args.names[0])
        note(f"job token {token_id} revoked; every master refuses it within seconds")
        if args.json:
            print_json({"token_id": token_id, "revoked": True})
        return 0
    from blobha.core.auth import hash_token, new_token
    from blobha.core.errors import Unauthenticated

    try:
        if args.action == "create":
            token = new_token(args.token_user)
        else:
            token = sys.stdin.readline().strip()
        line = hash_token(token)
    except Unauthenticated as exc:
        raise InvalidArgument(str(exc)) from None
    if args.action == "create" and args.out:
        # The token first: a hash appended for a token that could not be kept would be a
        # credential nobody holds.
        _write_private(args.out, token)
    if args.append:
        with open(args.append, "a") as f:
            f.write(line + "\n")
        note(f"added a line for {line.split(':', 1)[0]!r} to {args.append}")
    if args.json:
        # The token only where it was not written to --out (shown once, as without --json).
        shown = {"token": token} if args.action == "create" and not args.out else {}
        print_json({"user": line.split(":", 1)[0], "line": line, **shown,
                    "token_file": args.out, "appended_to": args.append})
        return 0
    if not args.append:
        print(line)
    if args.action == "create":
        if args.out:
            note(f"token written to {args.out}; pass it with --token-file")
        else:
            note("the token (shown once; the masters keep only its hash):")
            print(token)
    return 0


def _write_private(path: str, token: str) -> None:
    """``token`` alone in the file ``path``, mode 600 (the clients refuse a token file other
    accounts can read)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        # The mode given to open applies only to a new file; one that existed keeps its
        # own (often 0644) unless changed, before the token is in it.
        os.fchmod(f.fileno(), 0o600)
        f.write(token + "\n")


def _job_token(args: argparse.Namespace) -> int:
    with client_for(args) as c:
        issued = c.issue_job_token(args.names, args.lifetime)
    expires = datetime.fromtimestamp(issued.expires_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if args.out:
        _write_private(args.out, issued.token)
    if args.json:
        # The token only where it was not written to --out, as for 'token create'.
        shown = {} if args.out else {"token": issued.token}
        print(json.dumps({**shown, "token_id": issued.token_id,
                          "expires_at": issued.expires_at, "expires": expires,
                          "keys": list(issued.keys), "user": issued.user,
                          "token_file": args.out}, indent=2))
        return 0
    note(f"job token {issued.token_id} for {issued.user!r}: READ on {len(issued.keys)} keys"
         f" until {expires} (shown once; revoke with 'blobha token revoke {issued.token_id}')")
    if args.out:
        note(f"token written to {args.out}; pass it with --token-file")
    else:
        print(issued.token)
    return 0
