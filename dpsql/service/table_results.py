"""What every DP table function (dp_rule_list, the regressions) does after its release: the
released rows through the outer query's post-processing, and a named model kept in the store.
Both read released values only: post-processing, free."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dpsql.boundary import post_processing_boundary
from dpsql.frontend.statements import RuleListCall
from dpsql.service.results import Result, to_python, type_code

if TYPE_CHECKING:
    from dpsql.service.protocol import Service


def table_function_result(
    service: Service,
    call: RuleListCall,
    answer: str,
    cost: Any,
    columns: Sequence[tuple[str, str]],
) -> tuple[Result, dict]:
    """A DP table function's released rows (the cached JSON ``answer``) through the outer
    query's post-processing: the Result, and the decoded answer (notes, model)."""
    with post_processing_boundary():
        data = json.loads(answer)
        rows = [tuple(r) for r in data["rows"]]
        description, out_rows = service.scratch.post_process(
            call.post,
            [c for c, _ in columns],
            [t for _, t in columns],
            rows,
        )
    result = Result(
        [(n, type_code(t)) for n, t in description],
        [tuple(to_python(v) for v in r) for r in out_rows],
        intervals=[tuple(None for _ in description) for _ in out_rows],
        cost=cost,
        cached=cost is None,
    )
    result.notes = list(data["notes"])
    return result, data


def store_model(
    service: Service, plan: Any, kind: str, analyst: str, query: str, payload: dict, result: Result
) -> None:
    """Keep a released model under ``plan.model`` (post-processing: it costs nothing)."""
    from dpsql.models.store import ModelStore, model_record

    record = model_record(plan, kind, analyst, service.policy.dataset, query, payload)
    ModelStore.for_ledger(service.ledger).put(record)
    result.notes.append(f"stored as model {plan.model!r}: dp_predict('{plan.model}')")
