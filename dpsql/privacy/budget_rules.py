"""Budgets as a curator sets them: group budgets, a dataset-wide cap, monthly renewal.

The policy's ``[budgets]`` section (docs/ledger.md, "Group, dataset-wide and renewing
budgets")::

    [budgets]
    renew = "monthly"                         # analysts' and groups' budgets (default: never)
    dataset = { epsilon = 50, delta = 1e-5 }  # every analyst together; never renews unless
                                              # it says renew = "monthly" itself
    [budgets.groups]
    clinicians = { epsilon = 5, delta = 1e-6 }                  # a role of [access] roles
    contractors = { epsilon = 2, members = ["dave", "erin"] }   # or its own member list

Every budget is the same filter as an analyst's (:class:`~dpsql.privacy.accounting.Budget`),
applied to a different running total: a group's is the sum of its members' charges, the
dataset's the sum of every analyst's. A charge must fit all of them (the analyst's own, each
group the analyst is in, the dataset's), checked and recorded in one ledger transaction.

The rules travel with the policy's default budget: :class:`PolicyBudget` is a
:class:`Budget` (the per-analyst default) that also carries :class:`BudgetRules`, so every
ledger call that passes ``policy.budget`` enforces them, and a plain ``Budget`` means "no
rules", exactly as before. This module imports no policy module (tests/test_layering.py).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dpsql.errors import BudgetExhaustedError
from dpsql.privacy.accounting import Budget, Cost

#: Renewal schedules a policy may name.
SCHEDULES = ("monthly",)

BUDGETS_KEYS = {
    "renew": "when analysts' and groups' budgets start afresh: \"monthly\" (default: never)",
    "groups": "group name -> { epsilon, delta, members }: a budget shared by a group",
    "dataset": "{ epsilon, delta, renew }: a cap on every analyst's spending together",
}
GROUP_KEYS = {
    "epsilon": "the group's total epsilon (all members together)",
    "delta": "the group's total delta (default: [privacy] budget_delta)",
    "members": "its analysts; default: the [access] role of the same name",
}
DATASET_KEYS = {
    "epsilon": "every analyst's epsilon together",
    "delta": "every analyst's delta together (default: [privacy] budget_delta)",
    "renew": '"monthly" to renew the cap too (default: never; see docs/ledger.md)',
}

Clock = Callable[[], _dt.datetime]


def utc_now() -> _dt.datetime:
    return _dt.datetime.now(_dt.UTC)


def period_of(schedule: str | None, now: _dt.datetime) -> str:
    """The period ``now`` falls in: "" for a budget that never renews, "YYYY-MM" (UTC) for a
    monthly one. Periods of one schedule sort as strings in time order."""
    if schedule is None:
        return ""
    at = now.astimezone(_dt.UTC) if now.tzinfo is not None else now
    return f"{at.year:04d}-{at.month:02d}"


def stale(recorded: str | None, current: str) -> bool:
    """Whether a total recorded in period ``recorded`` has renewed by ``current``.

    Only a *later* period renews: a total with no recorded period (charged before renewal
    was configured) or from a later one (the clock went back) still counts, so a renewal
    can never be triggered by anything but the calendar moving forward."""
    return bool(current) and recorded is not None and recorded < current


@dataclass(frozen=True)
class Group:
    """A budget shared by ``members``: the sum of their charges must fit ``budget``."""

    name: str
    budget: Budget
    members: frozenset[str]


@dataclass(frozen=True)
class BudgetRules:
    """The shared and renewing budgets of one policy."""

    groups: tuple[Group, ...] = ()
    dataset: Budget | None = None
    renew: str | None = None  # the analysts' and groups' budgets
    dataset_renew: str | None = None  # the dataset-wide cap: only when the curator says so

    def groups_of(self, analyst: str) -> tuple[Group, ...]:
        return tuple(g for g in self.groups if analyst in g.members)

    def pools(self, analyst: str | None = None) -> list[Pool]:
        """The shared budgets a charge of ``analyst`` must fit (None: all of them)."""
        groups = self.groups if analyst is None else self.groups_of(analyst)
        out = [Pool(f"group:{g.name}", "group", g.name, g.budget, self.renew) for g in groups]
        if self.dataset is not None:
            out.append(Pool("dataset", "dataset", "", self.dataset, self.dataset_renew))
        return out

    @property
    def empty(self) -> bool:
        return not self.groups and self.dataset is None and self.renew is None


@dataclass(frozen=True)
class Pool:
    """One shared budget: its ledger key ("group:NAME" or "dataset"), and its schedule."""

    key: str
    kind: str  # "group" or "dataset"
    name: str
    budget: Budget
    renew: str | None


@dataclass(frozen=True)
class PolicyBudget(Budget):
    """The policy's per-analyst default budget, with the policy's :class:`BudgetRules`."""

    rules: BudgetRules = field(default_factory=BudgetRules)


def rules_of(default: Budget) -> BudgetRules | None:
    """The rules a default budget carries; None for a plain Budget (no shared budgets)."""
    rules = getattr(default, "rules", None)
    return rules if isinstance(rules, BudgetRules) and not rules.empty else None


@dataclass(frozen=True)
class LimitStatus:
    """One budget that applies to an analyst, and what it has spent in its current period."""

    kind: str  # "analyst", "group" or "dataset"
    name: str  # the analyst, the group; "" for the dataset
    budget: Budget
    spent: Cost
    period: str  # "" never renews, else "YYYY-MM"
    charges: int = 0

    @property
    def label(self) -> str:
        if self.kind == "group":
            return f"group {self.name}"
        if self.kind == "dataset":
            return "dataset"
        return "analyst"

    @property
    def owner(self) -> str:
        """Whose budget, as a refusal says it."""
        if self.kind == "group":
            return f"the group {self.name}'"
        if self.kind == "dataset":
            return "the dataset-wide"
        return f"analyst {self.name!r}'s"

    @property
    def remaining(self) -> tuple[float, float]:
        return self.budget.remaining(self.spent)

    @property
    def epsilon_spent(self) -> float:
        return self.budget.epsilon_of(self.spent)


def binding(limits: list[LimitStatus]) -> LimitStatus:
    """The limit with the least ε left (then the least δ): the one the analyst meets first."""
    return min(limits, key=lambda s: s.remaining)


def _amount(cost: Cost) -> str:
    parts = [f"\u03b5 {cost.epsilon:.6g}"]
    if cost.exact_delta:
        parts.append(f"\u03b4 {cost.delta:.3g}")
    if cost.exact_rho:
        parts.append(f"\u03c1 {cost.rho:.6g}")
    return ", ".join(parts)


def exceeded(limit: LimitStatus, cost: Cost) -> BudgetExhaustedError:
    """The refusal of a charge that a shared budget cannot take: which one, and by how much."""
    when = f" in {limit.period}" if limit.period else ""
    spent = limit.spent
    over = limit.budget.refusal_reason(spent + cost)
    return BudgetExhaustedError(
        f"{limit.owner} budget would be exceeded: spent \u03b5 {limit.epsilon_spent:.6g} of "
        f"{limit.budget.epsilon:.6g}{when}, this query {_amount(cost)} ({over})",
        construct="budget",
        hint="lower the query's epsilon (SET epsilon = ...), or ask the curator: this budget "
        "is shared ([budgets] in the policy)"
        + (", and starts afresh next period" if limit.period else ""),
    )


# -- the policy's [budgets] section --------------------------------------------------------------

Reporter = Any  # dpsql.policy._Reporter (duck-typed: this module imports no policy module)


def _schedule(rep: Reporter, key: str, value: Any) -> str | None:
    if value is None:
        return None
    if value not in SCHEDULES:
        raise rep.fail(
            key,
            f"unknown schedule {value!r}",
            'use renew = "monthly" (budgets start afresh on the 1st of each month, UTC), '
            "or leave it out for budgets that never renew",
        )
    return str(value)


def _budget(rep: Reporter, key: str, spec: Any, base: Budget, keys: Mapping[str, str]) -> Budget:
    if not isinstance(spec, dict):
        raise rep.fail(key, "must be a table", f"e.g. {key.rsplit('.', 1)[-1]} = {{ epsilon = 5 }}")
    rep.unknown_keys(key, spec, keys)
    if "epsilon" not in spec:
        raise rep.fail(f"{key}.epsilon", "missing", "e.g. epsilon = 5")
    values = []
    for part, default in (("epsilon", None), ("delta", base.delta)):
        value = spec.get(part, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise rep.fail(f"{key}.{part}", f"expected a number, got {value!r}", "e.g. 5 or 1e-6")
        values.append(float(value))
    epsilon, delta = values
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise rep.fail(f"{key}.epsilon", f"must be finite and > 0, got {epsilon!r}", "e.g. 5")
    if not 0 <= delta < 1:
        raise rep.fail(f"{key}.delta", f"must be in [0, 1), got {delta!r}", "e.g. delta = 1e-6")
    if base.gaussian_share > 0 and delta == 0:
        raise rep.fail(
            f"{key}.delta",
            "the policy spends a Gaussian share, which needs delta > 0 in every budget",
            "set delta = 1e-6, or leave delta out to use [privacy] budget_delta",
        )
    # the policy's split of a budget (Gaussian share, the δ share of the zCDP conversion)
    return dataclasses.replace(base, epsilon=epsilon, delta=delta)


def build_rules(
    rep: Reporter,
    section: Any,
    base: Budget,
    roles: Mapping[str, frozenset[str]],
    analysts: frozenset[str] | None,
) -> Budget:
    """Validate ``[budgets]``; the per-analyst default ``base``, with the rules when given."""
    if section is None:
        return base
    if not isinstance(section, dict):
        raise rep.fail("budgets", "must be a table", "write a [budgets] section")
    rep.unknown_keys("budgets", section, BUDGETS_KEYS)
    renew = _schedule(rep, "budgets.renew", section.get("renew"))
    groups_raw = section.get("groups", {})
    if not isinstance(groups_raw, dict):
        raise rep.fail(
            "budgets.groups",
            "must be a table of budgets",
            "groups = { clinicians = { epsilon = 5, delta = 1e-6 } }",
        )
    groups = []
    for name, spec in groups_raw.items():
        key = f"budgets.groups.{name}"
        budget = _budget(rep, key, spec, base, GROUP_KEYS)
        members = spec.get("members")
        if members is None:
            if name not in roles:
                known = ", ".join(sorted(roles)) or "none"
                raise rep.fail(
                    key,
                    f"{name!r} is not a role of [access] roles (roles: {known})",
                    'add the role to [access] roles, or list its analysts: members = ["alice"]',
                )
            members_set = roles[name]
        else:
            if not isinstance(members, list) or not all(isinstance(m, str) and m for m in members):
                raise rep.fail(
                    f"{key}.members", "must be a list of analyst names", 'members = ["alice"]'
                )
            if name in roles:
                raise rep.fail(
                    f"{key}.members",
                    f"{name!r} is also a role of [access] roles: which members count is unclear",
                    "remove members (the role's analysts count), or rename the group",
                )
            for member in members:
                if member in roles:
                    raise rep.fail(
                        f"{key}.members",
                        f"{member!r} is a role",
                        "list analysts, or name the group after the role and drop members",
                    )
                if analysts is not None and member not in analysts:
                    raise rep.fail(
                        f"{key}.members",
                        f"{member!r} is not an analyst of [privacy] analysts",
                        "add it to [privacy] analysts, or fix the name",
                    )
            members_set = frozenset(members)
        groups.append(Group(str(name), budget, members_set))
    dataset = None
    dataset_renew = None
    if "dataset" in section:
        spec = section["dataset"]
        dataset = _budget(rep, "budgets.dataset", spec, base, DATASET_KEYS)
        dataset_renew = _schedule(rep, "budgets.dataset.renew", spec.get("renew"))
    rules = BudgetRules(tuple(groups), dataset, renew, dataset_renew)
    if rules.empty:
        return base
    return PolicyBudget(
        base.epsilon, base.delta, base.gaussian_share, base.conversion_delta_share, rules=rules
    )
