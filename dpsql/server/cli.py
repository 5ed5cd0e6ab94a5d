"""``dpsql serve`` and ``dpsql user add/list/remove``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import getpass
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from dpsql.server.users import UserStore, UserStoreError, users_path


def register(subparsers: Any) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="serve the PostgreSQL wire protocol (psql, JDBC, psycopg, BI tools)",
        description="Accept PostgreSQL clients; each login is an analyst with its own budget.",
    )
    serve.add_argument("--policy", required=True, help="privacy policy (TOML)")
    serve.add_argument("--database", default=":memory:", help="DuckDB database for the data")
    serve.add_argument(
        "--engine", choices=("duckdb", "spark"), help="engine (default: the policy's [engine])"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=5433, help="TCP port (default 5433)")
    serve.add_argument("--tls-cert", help="PEM certificate chain: enables TLS (sslmode=require)")
    serve.add_argument("--tls-key", help="PEM private key of --tls-cert")
    serve.add_argument(
        "--tls-required", action="store_true", help="refuse clients that do not use TLS"
    )
    serve.add_argument("--users", help="users file (default: <policy stem>.users.json)")
    serve.add_argument(
        "--max-connections", type=int, default=100, help="for the whole server (default 100)"
    )
    serve.add_argument(
        "--max-connections-per-login",
        type=int,
        help="authenticated sessions one login may hold (default: the policy's [server] "
        "max_connections_per_login, else a quarter of --max-connections)",
    )
    serve.add_argument(
        "--max-connections-per-address",
        type=int,
        help="connections from one IP address (default: the policy's [server] "
        "max_connections_per_address, else half of --max-connections)",
    )
    serve.add_argument(
        "--auth-timeout",
        type=float,
        help="seconds to finish startup, TLS and login (default: the policy's [server] "
        "auth_timeout, else 5)",
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes behind the one port, each with its own engine, sharing the "
        "ledger (default 1: one process; 0: one per CPU)",
    )
    serve.add_argument(
        "--analyst-statements",
        type=int,
        help="statements of one analyst that run at once in a server process; more wait their "
        "turn (default: the policy's [server] analyst_statements, else 2)",
    )
    serve.add_argument(
        "--analyst-cpu-share",
        type=float,
        help="cores one analyst may use, sustained, before its statements run one at a time "
        "behind the others' (default: the policy's [server] analyst_cpu_share, else 0.25)",
    )
    serve.add_argument(
        "--no-cache",
        action="store_true",
        help="disable the answer cache: re-runs are charged again (for benchmarks)",
    )
    from dpsql.admin.cli import add_options as admin_options

    admin_options(serve, serving=True)  # --admin-port: the curator page (docs/curator.md)
    serve.set_defaults(handler=_serve)

    user = subparsers.add_parser("user", help="manage the analysts who may log in to the server")
    user_sub = user.add_subparsers(dest="user_command", metavar="ACTION", required=True)
    add = user_sub.add_parser("add", help="add (or with --replace, change) a login")
    add.add_argument("name")
    add.add_argument("--policy", required=True)
    add.add_argument("--users", help="users file (default: <policy stem>.users.json)")
    add.add_argument("--password-stdin", action="store_true", help="read the password from stdin")
    add.add_argument("--replace", action="store_true", help="change an existing user's password")
    add.set_defaults(handler=_user_add)
    lst = user_sub.add_parser("list", help="list logins")
    lst.add_argument("--policy", required=True)
    lst.add_argument("--users")
    lst.set_defaults(handler=_user_list)
    rm = user_sub.add_parser("remove", help="remove a login (its ledger history stays)")
    rm.add_argument("name")
    rm.add_argument("--policy", required=True)
    rm.add_argument("--users")
    rm.set_defaults(handler=_user_remove)


def _store(args: argparse.Namespace) -> UserStore:
    return UserStore(args.users or users_path(args.policy))


def _user_add(args: argparse.Namespace) -> int:
    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    else:
        password = getpass.getpass(f"Password for {args.name}: ")
        if password != getpass.getpass("Repeat: "):
            print("dpsql: passwords do not match", file=sys.stderr)
            return 1
    try:
        _store(args).add(args.name, password, replace=args.replace)
    except UserStoreError as exc:
        print(f"dpsql: {exc}", file=sys.stderr)
        return 1
    print(f"user {args.name} saved in {_store(args).path}")
    return 0


def _user_list(args: argparse.Namespace) -> int:
    try:
        for name in _store(args).names():
            print(name)
    except UserStoreError as exc:
        print(f"dpsql: {exc}", file=sys.stderr)
        return 1
    return 0


def _user_remove(args: argparse.Namespace) -> int:
    try:
        _store(args).remove(args.name)
    except UserStoreError as exc:
        print(f"dpsql: {exc}", file=sys.stderr)
        return 1
    print(f"user {args.name} removed")
    return 0


def _check_users(args: argparse.Namespace) -> bool:
    store = _store(args)
    try:
        if not store.names():
            print(
                f"dpsql: warning: no users in {store.path}; add one with "
                f"`dpsql user add NAME --policy {args.policy}`",
                file=sys.stderr,
            )
    except UserStoreError as exc:
        print(f"dpsql: {exc}", file=sys.stderr)
        return False
    return True


def _fairness(args: argparse.Namespace) -> tuple[Any, Any]:
    """The policy file's [server] settings (the scheduler's and the connections') with the
    command line's overrides (FairnessError)."""
    from dpsql.server.connections import server_settings_from_policy_file

    limits, connections = server_settings_from_policy_file(args.policy)
    conn_changes = {
        key: value
        for key, value in (
            ("max_connections_per_login", args.max_connections_per_login),
            ("max_connections_per_address", args.max_connections_per_address),
            ("auth_timeout", args.auth_timeout),
        )
        if value is not None
    }
    connections = dataclasses.replace(connections, **conn_changes)
    changes = {
        key: value
        for key, value in (
            ("analyst_statements", args.analyst_statements),
            ("analyst_cpu_share", args.analyst_cpu_share),
        )
        if value is not None
    }
    if "analyst_statements" in changes:  # keep heavy_statements within the new cap
        changes["heavy_statements"] = max(
            1, min(limits.heavy_statements, changes["analyst_statements"])
        )
    return dataclasses.replace(limits, **changes), connections


def _serve(args: argparse.Namespace) -> int:
    import asyncio  # here, not at the top: dpsql --help and the one-shot commands need none

    from dpsql.errors import Error
    from dpsql.pipeline import Service
    from dpsql.server.fairness import FairnessError
    from dpsql.server.server import Server, tls_context, tune_interpreter

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    tune_interpreter()
    if bool(args.tls_cert) != bool(args.tls_key):
        print("dpsql: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    try:
        fairness, connections = _fairness(args)
    except FairnessError as exc:
        print(f"dpsql: {exc.message}" + (f" ({exc.hint})" if exc.hint else ""), file=sys.stderr)
        return 2
    workers = args.workers if args.workers > 0 else (os.cpu_count() or 1)
    if workers > 1:
        return _serve_workers(args, workers, fairness, connections)
    try:
        service = Service(args.policy, args.database, cache=not args.no_cache, engine=args.engine)
    except Error as exc:
        print(f"dpsql: {exc}", file=sys.stderr)
        return 1
    if not _check_users(args):
        return 1
    from dpsql.admin.cli import start_for_serve

    admin = start_for_serve(args, service)
    if admin is False:
        service.close()
        return 1
    ctx = tls_context(args.tls_cert, args.tls_key) if args.tls_cert else None
    server = Server(
        service,
        _store(args),
        ssl_context=ctx,
        require_tls=args.tls_required,
        max_connections=args.max_connections,
        fairness=fairness,
        connections=connections,
    )

    async def main() -> None:
        port = await server.start(args.host, args.port)
        print(f"dpsql serving {args.policy} on {args.host}:{port}", flush=True)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.close()

    asyncio.run(main())
    if admin:
        admin.close()
    service.close()
    return 0


def _serve_workers(args: argparse.Namespace, workers: int, fairness: Any, connections: Any) -> int:
    """Check what can be checked once (policy, engine, TLS files, ledger), then supervise."""
    from dpsql.errors import Error
    from dpsql.policy import load_policy
    from dpsql.privacy.sqlite_ledger import SQLiteLedger
    from dpsql.server import supervisor
    from dpsql.server.server import tls_context
    from dpsql.server.worker import WorkerConfig

    try:
        policy = load_policy(args.policy)
        if args.tls_cert:
            tls_context(args.tls_cert, args.tls_key)
        if policy.ledger_path is not None:
            # Create the file and switch it to WAL once, before N processes open it at once.
            SQLiteLedger(policy.ledger_path).close()
    except (Error, OSError) as exc:
        print(f"dpsql: {exc}", file=sys.stderr)
        return 1
    if (args.engine or policy.engine.name) != "duckdb":
        print(
            "dpsql: --workers > 1 needs the DuckDB engine (each worker would start its own "
            "Spark session); use --workers 1",
            file=sys.stderr,
        )
        return 2
    if policy.ledger_path is None:
        print(
            "dpsql: --workers > 1 needs a ledger file in the policy ([privacy] ledger = ...): "
            "an in-memory ledger per worker would give each analyst one budget per worker",
            file=sys.stderr,
        )
        return 2
    if not _check_users(args):
        return 1
    config = WorkerConfig(
        policy=str(Path(args.policy).resolve()),
        database=args.database
        if args.database in (":memory:", "")
        else str(Path(args.database).resolve()),
        engine=args.engine,
        cache=not args.no_cache,
        users=str(Path(args.users or users_path(args.policy)).resolve()),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        require_tls=args.tls_required,
        max_connections=args.max_connections,
        mock_secret=os.urandom(32).hex(),
        fairness=dataclasses.asdict(fairness),
        # each worker allows its share of a login's sessions (the supervisor spreads
        # connections evenly); the supervisor counts addresses for the whole server
        connections=dataclasses.asdict(
            dataclasses.replace(
                connections,
                max_connections_per_login=-(
                    -connections.per_login(args.max_connections) // workers
                ),
                max_connections_per_address=connections.per_address(args.max_connections),
            )
        ),
    )
    from dpsql.admin.cli import start_for_serve

    admin = start_for_serve(args, None)  # the workers' engines are in other processes
    if admin is False:
        return 1
    try:
        return supervisor.serve(
            config,
            workers,
            host=args.host,
            port=args.port,
            max_connections=args.max_connections,
            announce=f"dpsql serving {args.policy} with {workers} workers on {args.host}",
        )
    finally:
        if admin:
            admin.close()
