"""``SELECT … FROM dp_rule_list(…)``: plan, charge, count, release, post-process, store.

The same order as every DP query (DESIGN.md, the privacy boundary): the arguments are typed and
the generated SQL bound on the schema-only shadow before anything is read (a refusal is free);
the ledger is checked, the cost reserved, then the engine counts the (features, label) patterns
and the learner runs on those weights inside the charged boundary; post-processing of the
released rows happens last. The regression table functions follow the same steps
(dpsql.models.regression_function).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import secrets
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from dpsql.engine.api import cancel_check
from dpsql.engine.scratch import check_post
from dpsql.errors import ProgrammingError
from dpsql.frontend.statements import DIALECT, RuleListCall
from dpsql.frontend.typecheck import check_binds
from dpsql.lower.hashing import with_secret
from dpsql.lower.rows import bound_note, pattern_counts
from dpsql.plan.canonical import canonical
from dpsql.service.table_results import store_model, table_function_result
from dpsql.service.transaction import paid_once

if TYPE_CHECKING:
    from dpsql.engine.api import QueryHandle
    from dpsql.service.protocol import Service
    from dpsql.service.results import Result
    from dpsql.service.settings import Settings


def plan_rule_list_call(service: Service, call: RuleListCall, settings: Settings) -> Any:
    """The rule list's plan from the call's typed arguments and the session's ε/δ."""
    from dpsql.rulelist.table_function import plan_rule_list

    arguments = dict(call.arguments)
    arguments.setdefault("epsilon", settings.epsilon)
    if "delta" not in arguments and settings.delta > 0:
        arguments["delta"] = settings.delta
    if isinstance(arguments.get("features"), str):
        arguments["features"] = [f.strip() for f in arguments["features"].split(",") if f.strip()]
    known = set(inspect.signature(plan_rule_list).parameters) - {"table"}
    for name in arguments:
        if name not in known:
            raise ProgrammingError(
                f"dp_rule_list has no argument {name!r}",
                sqlstate="42883",
                construct=name,
                hint="arguments: " + ", ".join(sorted(known)),
            )
    plan = plan_rule_list(call.table, **arguments)
    if "delta" not in call.arguments and plan.cost.delta > 0:
        plan = replace(
            plan,
            notes=(
                f"delta => not given: the session's delta = {plan.cost.delta:.3g} is the "
                "total delta of the list (SET delta = ... or pass delta => ...)",
            ),
        )
    # Generated from the policy and typed arguments; bound here on the empty shadow too,
    # so that a type error is a free refusal and never an engine error after the reserve.
    check_binds(service.shadow, call.table.name, plan.expressions())
    return plan


def run_rule_list(
    service: Service,
    call: RuleListCall,
    settings: Settings,
    analyst: str,
    handle: QueryHandle | None,
) -> Result:
    from dpsql.rulelist.table_function import COLUMNS, release_rule_list

    plan = plan_rule_list_call(service, call, settings)
    # The post-processing's functions are checked before the charge: a refusal is free.
    check_post(call.post.sql(dialect=DIALECT), call.post)
    fingerprint = hashlib.sha256(
        repr(
            (
                call.table.name,
                # the table as the policy declares it (dpsql.plan.canonical): an edit of its
                # columns, bounds or unit is another model, not a replay of the old one
                canonical(call.table),
                sorted(call.arguments.items()),
                settings.as_dict(),
                service.data_version(call.table),
            )
        ).encode()
    ).hexdigest()
    columns = [f"f{i}" for i in range(len(plan.predicates))] + ["y"]
    counts = pattern_counts(call.table, plan.items(), columns)
    query = with_secret(counts, secrets.randbits(62))

    def execute() -> tuple[str, bool]:
        counted = service.engine.fetch_matrix(query, handle)
        # One row per distinct (features, label) pattern with its count: the learner
        # works on these weights, never on one row per sample.
        released = release_rule_list(
            plan,
            counted[:, :-2],
            counted[:, -2],
            service.noise,
            weights=counted[:, -1],
            check=cancel_check(handle),
        )
        answer = {
            "rows": [list(r) for r in released.rows],
            "notes": list(released.notes),
            "model": plan.model_payload(released.rule_list),
        }
        return json.dumps(answer), True

    paid = paid_once(
        service, analyst, text=call.text, plan_hash=fingerprint, cost=plan.cost, handle=handle,
        execute=execute, cache_key="rulelist:" + fingerprint,
    )  # fmt: skip
    answer, cost, not_cached = paid.answer, paid.charged, paid.note
    result, data = table_function_result(service, call, answer, cost, COLUMNS)
    if not_cached:
        result.notes.append(not_cached)
    if plan.model is not None and "model" in data:
        store_model(service, plan, "rule_list", analyst, call.text, data["model"], result)
    return result


def explain_rule_list(service: Service, call: RuleListCall, settings: Settings) -> Result:
    from dpsql.service.results import EXPLAIN_COLUMNS, Result

    plan = plan_rule_list_call(service, call, settings)
    result = Result(EXPLAIN_COLUMNS, plan.explain_rows(), status="EXPLAIN")
    result.notes = [*plan.notes, bound_note(call.table)]  # the rows' bounding (dpsql.lower.rows)
    return result
