"""``dpsql model list|show|export|delete``: an analyst's stored models, as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from dpsql.errors import Error


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``dpsql model`` and its subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--policy", required=True, help="privacy policy (TOML): its ledger file")
    common.add_argument("--analyst", default="default", help="whose models")
    model = subparsers.add_parser(
        "model",
        help="list, show, export or delete stored models (JSON)",
        description="Models stored by dp_rule_list(..., model => 'name'), per analyst and "
        "dataset, in the policy's ledger file. Nothing here reads data or spends budget.",
    )
    sub = model.add_subparsers(dest="model_command", metavar="COMMAND", required=True)
    p = sub.add_parser("list", parents=[common], help="name, kind, cost and query of each")
    p.set_defaults(handler=_list)
    for name, help_text, handler in (
        ("show", "one model's record, its parameters decoded", _show),
        ("export", "one model's parameters only (what dp_predict applies)", _export),
        ("delete", "remove one model", _delete),
    ):
        p = sub.add_parser(name, parents=[common], help=help_text)
        p.add_argument("name")
        p.set_defaults(handler=handler)


def _store(args: argparse.Namespace):
    from dpsql.models.store import ModelStore
    from dpsql.policy import load_policy

    policy = load_policy(args.policy)
    if policy.ledger_path is None:
        raise SystemExit("error: this policy has no ledger file, so no stored models")
    return ModelStore(policy.ledger_path), policy.dataset


def _get(args: argparse.Namespace):
    store, dataset = _store(args)
    found = store.get(args.analyst, dataset, args.name)
    if found is None:
        print(
            f"error: [42704] model {args.name!r} does not exist for analyst {args.analyst!r}",
            file=sys.stderr,
        )
    return found


def _list(args: argparse.Namespace) -> int:
    try:
        store, dataset = _store(args)
        print(json.dumps([m.summary() for m in store.list(args.analyst, dataset)], indent=2))
    except Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _show(args: argparse.Namespace) -> int:
    found = _get(args)
    if found is None:
        return 1
    record = asdict(found)
    record["model"] = json.loads(record.pop("model_json"))
    print(json.dumps(record, indent=2))
    return 0


def _export(args: argparse.Namespace) -> int:
    found = _get(args)
    if found is None:
        return 1
    print(json.dumps({"kind": found.kind, **json.loads(found.model_json)}, indent=2))
    return 0


def _delete(args: argparse.Namespace) -> int:
    store, dataset = _store(args)
    if not store.delete(args.analyst, dataset, args.name):
        print(f"error: [42704] model {args.name!r} does not exist", file=sys.stderr)
        return 1
    print(f"deleted model {args.name!r}")
    return 0
