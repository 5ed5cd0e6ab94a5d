"""``dpsql dashboard`` (the curator page on its own) and the ``--admin-*`` options of ``dpsql
serve`` (the same page inside the serving process, with its engine's data versions and stores)."""

from __future__ import annotations

import argparse
import ipaddress
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from dpsql.admin import DEFAULT_USER

# dpsql.admin.page and .server are imported when a page starts: `dpsql --help` stays light.


def add_options(parser: argparse.ArgumentParser, *, serving: bool) -> None:
    """The curator page's options (``dpsql serve``: all prefixed --admin-)."""
    prefix = "--admin-" if serving else "--"
    token_option = prefix + "token-file"
    if serving:
        parser.add_argument(
            "--admin-port",
            type=int,
            metavar="PORT",
            help="also serve the read-only curator page on this HTTP port (0: any free one); "
            "operator-only, see docs/curator.md",
        )
    parser.add_argument(
        prefix + "host",
        dest="admin_host",
        default="127.0.0.1",
        metavar="ADDR",
        help="address of the curator page (default 127.0.0.1; it is plain HTTP)",
    )
    parser.add_argument(
        token_option,
        dest="admin_token_file",
        metavar="FILE",
        help="the operator's token: first line of a file only its owner may read (default: a "
        "random token, printed at start)",
    )
    parser.set_defaults(admin_token_option=token_option)
    parser.add_argument(
        "--admin-user",
        dest="admin_user",
        default=DEFAULT_USER,
        metavar="NAME",
        help=f"the operator's login name on the page (default {DEFAULT_USER!r}; never an "
        "analyst's)",
    )


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "dashboard",
        help="serve the read-only curator page: budgets, query log, tables, data versions",
        description="Serve a read-only web page for the operator: each analyst's budget "
        "(spent, remaining, over time), the ledger's query log, the tables and their policy, "
        "the data versions and prepared stores. HTTP Basic with the operator's name and "
        "token; bound to 127.0.0.1 by default. `dpsql serve --admin-port` serves the same "
        "page inside the server, with its engine's live data versions. See docs/curator.md.",
    )
    p.add_argument("--policy", required=True, help="privacy policy (TOML)")
    p.add_argument(
        "--ledger", help="the budget ledger (default: the policy's [privacy] ledger path)"
    )
    p.add_argument("--users", help="users file of dpsql serve (default: <policy stem>.users.json)")
    p.add_argument("--port", type=int, default=8433, help="HTTP port (default 8433; 0: any)")
    add_options(p, serving=False)
    p.set_defaults(handler=_dashboard)


def _logins(users: str | Path) -> Any:
    from dpsql.server.users import UserStore

    store = UserStore(users)
    return store.names


def start(args: argparse.Namespace, reader: Any, port: int) -> Any:
    """Start the page from a thread and announce where and how to log in (AdminError)."""
    from dpsql.admin.server import AdminServer, new_token, read_token

    token = read_token(args.admin_token_file) if args.admin_token_file else new_token()
    server = AdminServer(
        reader, token=token, user=args.admin_user, host=args.admin_host, port=port
    ).start()
    how = (
        f"token from {args.admin_token_file}"
        if args.admin_token_file
        else f"token {token} (shown once; {args.admin_token_option} FILE chooses one)"
    )
    print(f"dpsql curator page on {server.url} (user {args.admin_user!r}, {how})", flush=True)
    if not _loopback(args.admin_host):
        print(
            f"dpsql: warning: the curator page listens on {args.admin_host}, beyond this "
            "machine, over plain HTTP: its token travels in clear; prefer 127.0.0.1 and an "
            "SSH tunnel or a TLS proxy",
            file=sys.stderr,
        )
    return server


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serving_reader(args: argparse.Namespace, service: Any | None) -> Any:
    """``dpsql serve``'s page: the service's own engine when it runs in this process, else
    (``--workers`` > 1: engines in other processes) what the policy file tells."""
    from dpsql.admin.page import Reader
    from dpsql.policy import load_policy
    from dpsql.server.users import users_path

    logins = _logins(args.users or users_path(args.policy))
    if service is None:
        return Reader(load_policy(args.policy), logins=logins)
    tables = service.policy.tables
    return Reader(
        service.policy,
        versions=lambda: {name: service.data_version(t) for name, t in tables.items()},
        stores=lambda: list(getattr(service.engine, "stores", ())),
        logins=logins,
    )


def start_for_serve(args: argparse.Namespace, service: Any | None) -> Any:
    """``dpsql serve``: the started page if ``--admin-port`` was given, else None; False
    when it cannot start (the reason printed). ``service`` None: workers in other processes."""
    from dpsql.admin.server import AdminError
    from dpsql.errors import Error

    if getattr(args, "admin_port", None) is None:
        return None
    try:
        return start(args, serving_reader(args, service), args.admin_port)
    except (Error, AdminError, OSError) as exc:
        print(f"dpsql: the curator page cannot start: {exc}", file=sys.stderr)
        return False


def _dashboard(args: argparse.Namespace) -> int:
    import dataclasses

    from dpsql.admin.page import Reader
    from dpsql.admin.server import AdminError
    from dpsql.errors import Error
    from dpsql.policy import load_policy
    from dpsql.server.users import users_path

    try:
        policy = load_policy(args.policy)
        if args.ledger:
            policy = dataclasses.replace(policy, ledger_path=Path(args.ledger).resolve())
        reader = Reader(policy, logins=_logins(args.users or users_path(args.policy)))
        server = start(args, reader, args.port)
    except (Error, AdminError, OSError) as exc:
        print(f"dpsql dashboard: error: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.close()
    return 0
