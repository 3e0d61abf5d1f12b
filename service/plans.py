"""Plans: the limits a guild buys, as data (DESIGN section 3).

The defaults live here; operators override or add plans in the `[plans.NAME]`
tables of the configuration file (see `service.settings`).  Nothing else in the
project hard-codes a limit: every check reads a `Plan`.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from types import MappingProxyType
from typing import Mapping


@dataclass(frozen=True)
class Plan:
    """The limits of one plan; 0/False means "not included"."""

    name: str
    endpoints: int
    memory_kb: int
    requests_per_minute: int
    body_bytes: int
    history: int
    error_logs: bool
    ip_whitelist: bool
    advanced_stats: bool
    time_limit_ms: int
    #: Live scripts per guild (created and not deleted). Not in the product's
    #: plan table; without it one guild could fill the database with
    #: 256 KB sources (security review, session 16). Has a default, so a
    #: `[plans.NAME]` written before it need not name it.
    scripts: int = 100


#: Field names an operator may set in `[plans.NAME]`, in declaration order.
PLAN_KEYS: tuple[str, ...] = tuple(f.name for f in fields(Plan) if f.name != "name")
#: Those a new plan may leave out (they have a default).
OPTIONAL_PLAN_KEYS: frozenset[str] = frozenset(
    f.name for f in fields(Plan) if f.default is not MISSING)

FREE = Plan(
    name="free", endpoints=0, memory_kb=0, requests_per_minute=0, body_bytes=0,
    history=0, error_logs=False, ip_whitelist=False, advanced_stats=False,
    time_limit_ms=0, scripts=10,
)
PLUS = Plan(
    name="plus", endpoints=3, memory_kb=512, requests_per_minute=30,
    body_bytes=131072, history=20, error_logs=True, ip_whitelist=False,
    advanced_stats=False, time_limit_ms=1000, scripts=30,
)
PRO = Plan(
    name="pro", endpoints=9, memory_kb=4096, requests_per_minute=120,
    body_bytes=1048576, history=200, error_logs=True, ip_whitelist=True,
    advanced_stats=True, time_limit_ms=1000, scripts=100,
)

DEFAULT_PLANS: Mapping[str, Plan] = MappingProxyType({p.name: p for p in (FREE, PLUS, PRO)})

#: The plan a new guild gets when none is named.
DEFAULT_PLAN_NAME = "free"


def resolve_plan(plans: Mapping[str, Plan], name: str) -> Plan:
    """Return the plan called `name`; a name the configuration no longer has
    (an operator removed the plan) behaves like `free`, so it fails closed."""
    plan = plans.get(name)
    if plan is not None:
        return plan
    return Plan(name=name, **{k: getattr(FREE, k) for k in PLAN_KEYS})
