"""A session's privacy settings (epsilon, delta, mechanism, confidence) and SET / RESET."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dpsql.errors import (
    ProgrammingError,
)
from dpsql.frontend.statements import SettingStatement
from dpsql.policy import MECHANISMS, Policy
from dpsql.service.results import Result

QUANTILE_METHODS = ("em", "pf", "smooth")
ON_OFF = ("on", "off")


@dataclass
class Settings:
    """A session's privacy settings, changed with SET / RESET."""

    epsilon: float
    delta: float
    mechanism: str
    confidence: float = 0.95  # level of the reported noise intervals: post-processing only
    # MEDIAN/PERCENTILE/MIN/MAX: "em" (exponential mechanism), "pf" (permute-and-flip, same
    # ε, never worse in expectation) or "smooth" (MEDIAN only: smooth sensitivity + Cauchy)
    quantile_method: str = "em"
    # non-public GROUP BY keys: optimal selection, τ-threshold, or whichever keeps more
    partition_selection: str = "auto"
    # the SQL dialect statements are read in (dpsql.frontend.dialect): chosen by the door, "duckdb"
    # for the DB-API and CLI, "postgres" for the wire server; not a SET-table setting
    dialect: str = "duckdb"
    # what the bounds cut (docs/bias.md): "on" measures it from a share of ε (dpsql.plan.bias),
    # "off" spends all of ε on the answer; bias_interval "on" shows the interval widened by
    # the estimated bias beside each noise interval (post-processing only)
    # (a session starts with bias_estimate "on": from_policy; "off" here keeps a Settings
    # built by hand -- a planner test's -- at the split it states)
    bias_estimate: str = "off"
    bias_interval: str = "off"

    @classmethod
    def from_policy(cls, policy: Policy) -> Settings:
        return cls(policy.epsilon, policy.delta, policy.mechanism, bias_estimate="on")

    def as_dict(self) -> dict[str, Any]:
        """The settings a plan (and its cached answer) depends on."""
        return {"epsilon": self.epsilon, "delta": self.delta, "mechanism": self.mechanism}

    def shown(self) -> dict[str, Any]:
        """Every session setting (SET/SHOW/RESET): the privacy ones and the interval level."""
        # quantile_method / partition_selection are part of the plans they change (their
        # fingerprints), not of other answers
        return {
            **self.as_dict(),
            "quantile_method": self.quantile_method,
            "partition_selection": self.partition_selection,
            "confidence": self.confidence,
            "bias_estimate": self.bias_estimate,
            "bias_interval": self.bias_interval,
        }


def apply_setting(statement: SettingStatement, settings: Settings) -> Result:
    name = statement.name
    known = settings.shown()
    if name not in known:
        raise ProgrammingError(
            f"unknown setting {name!r}",
            sqlstate="42704",
            construct=name,
            hint="dpsql settings: " + ", ".join(known),
        )
    if statement.action == "show":
        return Result([(name, "VARCHAR")], [(str(known[name]),)], status="SHOW")
    if statement.action == "reset":
        # RESET goes back to the policy default, which the caller keeps in settings.defaults.
        raise ResetRequest(name)
    value = statement.value
    choices = _choices()
    if name in choices:
        allowed, hint = choices[name]
        if str(value).lower() not in allowed:
            raise ProgrammingError(
                f"unknown {name} {value!r}",
                sqlstate="22023",
                construct=name,
                hint=hint,
            )
        setattr(settings, name, str(value).lower())
    else:
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = float("nan")
        ranges = {
            "epsilon": (number > 0, "epsilon must be > 0"),
            "delta": (0 <= number < 1, "delta must be in [0, 1)"),
            "confidence": (0 < number < 1, "confidence must be in (0, 1), e.g. 0.9"),
        }
        ok, hint = ranges[name]
        if not (math.isfinite(number) and ok):
            raise ProgrammingError(
                f"invalid value for {name}: {value!r}",
                sqlstate="22023",
                construct=name,
                hint=hint,
            )
        setattr(settings, name, number)
    return Result(status="SET")


def _choices() -> dict[str, tuple[tuple[str, ...], str]]:
    """The settings that take one of a few words: what they allow and the hint."""
    from dpsql.plan.sharing import SELECTION_MODES

    return {
        "mechanism": (tuple(MECHANISMS), "SET mechanism = 'laplace' or 'gaussian'"),
        "quantile_method": (
            QUANTILE_METHODS,
            "SET quantile_method = 'em', 'pf' or 'smooth' (MEDIAN only)",
        ),
        "partition_selection": (
            SELECTION_MODES,
            "SET partition_selection = 'auto', 'optimal' or 'threshold'",
        ),
        "bias_estimate": (ON_OFF, "SET bias_estimate = on (default) or off"),
        "bias_interval": (ON_OFF, "SET bias_interval = on or off (default)"),
    }


class ResetRequest(Exception):
    """RESET of a setting the session holds (raised by the settings, handled by the session
    that owns them)."""

    def __init__(self, name: str) -> None:
        self.name = name


def reset_setting(settings: Settings, defaults: Settings, name: str) -> Result:
    setattr(settings, name, getattr(defaults, name))
    return Result(status="RESET")
