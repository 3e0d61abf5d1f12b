"""Endpoints: show, enable/disable within the plan's quota, IP whitelist.

Quota: a guild may have at most `plan.endpoints` enabled endpoints (free 0,
plus 3, pro 9 by default).  The count and the switch happen in one
transaction with the guild row locked, so two concurrent enables cannot pass
the quota together.

Whitelist (pro only): IPv4/IPv6 CIDRs or bare addresses.  Decision: a CIDR
with host bits set (`10.0.0.1/8`) is refused with the network it probably
means, not silently widened: a whitelist is a security rule, so we do not
guess.  Entries are normalised (`2001:DB8::/32` -> `2001:db8::/32`, bare
address -> /32 or /128), de-duplicated and sorted.  An empty list (no
restriction) may be set on any plan, so a downgraded guild can clear it.  On a
plan without the whitelist feature a stored whitelist is kept but not
enforced (`whitelistEnforced: false`); an upgrade enforces it again.
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
from typing import Any, Mapping, Sequence

from models import Endpoint, Script, database
from models.clock import iso, utcnow
from service.core import audit
from service.core.access import Actor, guild_and_script
from service.core.errors import QuotaError, ValidationError, VersionMismatchError
from service.plans import DEFAULT_PLANS, Plan, resolve_plan

MAX_WHITELIST = 100
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def endpoint_url(base_url: str, guild_id: str, script_id: str) -> str:
    """The public invoke URL (DESIGN section 4)."""
    return f"{base_url.rstrip('/')}/endpoints/{guild_id}/{script_id}"


def parse_whitelist(stored: str) -> tuple[IPNetwork, ...]:
    """The stored JSON list as networks (already validated on write)."""
    return tuple(ipaddress.ip_network(c) for c in json.loads(stored or "[]"))


def normalise_cidrs(cidrs: Sequence[str]) -> list[str]:
    """Validate and normalise; raises `ValidationError` naming the bad entry."""
    if len(cidrs) > MAX_WHITELIST:
        raise ValidationError(f"at most {MAX_WHITELIST} whitelist entries", code="invalid_cidr")
    nets: set[IPNetwork] = set()
    for raw in cidrs:
        text = str(raw).strip()
        shown = repr(text if len(text) <= 64 else text[:61] + "...")
        if "%" in text:
            # An IPv6 zone ("fe80::1%eth0") names an interface of the host
            # that reads it, not an address: it matches nothing more, and
            # Python takes any text after the "%" (review, session 25).
            raise ValidationError(f"invalid CIDR {shown}: zone ids (%...) are not allowed",
                                  code="invalid_cidr")
        try:
            nets.add(ipaddress.ip_network(text, strict=True))
        except ValueError:
            try:
                loose = ipaddress.ip_network(text, strict=False)
            except ValueError:
                raise ValidationError(f"invalid CIDR {shown}", code="invalid_cidr") from None
            raise ValidationError(f"invalid CIDR {shown}: host bits set (did you mean {loose}?)",
                                  code="invalid_cidr") from None
    ordered = sorted(nets, key=lambda n: (n.version, n.network_address, n.prefixlen))
    return [str(n) for n in ordered]


def _view(guild_id: str, script: Script, endpoint: Endpoint, plan: Plan,
          base_url: str | None) -> dict[str, Any]:
    secret = None
    if endpoint.secret_hash:
        secret = {"hint": endpoint.secret_hint, "createdAt": iso(endpoint.secret_created_at),
                  "createdBy": endpoint.secret_created_by}
    view: dict[str, Any] = {
        "guildId": guild_id, "logicScriptId": script.public_id,
        "enabled": bool(endpoint.enabled), "active": bool(endpoint.enabled) and plan.endpoints > 0,
        "secret": secret, "whitelist": json.loads(endpoint.whitelist or "[]"),
        "whitelistEnforced": plan.ip_whitelist and endpoint.whitelist not in (None, "", "[]"),
        "plan": plan.name,
    }
    if base_url:
        view["url"] = endpoint_url(base_url, guild_id, script.public_id)
    return view


def revision(view: Mapping[str, Any]) -> str:
    """What a settings editor read of an endpoint (its switch and whitelist), as
    the admin API's `ETag` carries it: a tag that changes with either, so a
    change sent against an older read is refused instead of undoing another
    (a review, session 30: two managers' whitelists, the second silently won)."""
    settings = json.dumps([bool(view["enabled"]), list(view["whitelist"])])
    return hashlib.sha256(settings.encode()).hexdigest()[:16]


def _refuse_stale(endpoint: Endpoint, expected: str | None) -> None:
    if expected is not None and expected != revision(
            {"enabled": endpoint.enabled, "whitelist": json.loads(endpoint.whitelist or "[]")}):
        raise VersionMismatchError("the endpoint's switch or whitelist changed since it was "
                                   "read: reload and retry")


def show_endpoint(actor: Actor, guild_id: str, script_id: str, *,
                  plans: Mapping[str, Plan] = DEFAULT_PLANS,
                  base_url: str | None = None) -> dict[str, Any]:
    """The endpoint: switch, secret hint (never the secret), whitelist, URL.
    Raises `NotFoundError`, `PermissionDeniedError`."""
    guild, script, _ = guild_and_script(actor, guild_id, script_id, "view endpoints")
    endpoint = Endpoint.get(Endpoint.script == script.id)
    return _view(guild.id, script, endpoint, resolve_plan(plans, guild.plan), base_url)


def set_enabled(actor: Actor, guild_id: str, script_id: str, enabled: bool, *,
                plans: Mapping[str, Plan] = DEFAULT_PLANS,
                base_url: str | None = None, expected_revision: str | None = None
                ) -> dict[str, Any]:
    """Switch the endpoint on or off (idempotent).  Raises `QuotaError`
    (`endpoint_quota` when the plan's quota is used up, `plan_feature` when
    the plan has no endpoints at all), `NotFoundError`,
    `PermissionDeniedError`, `VersionMismatchError` (not at `expected_revision`)."""
    with database.atomic():
        # Locked before the script is read: the quota count is serialised,
        # and a delete committed meanwhile is seen (the script read first, a
        # racing delete left an enabled endpoint on its tombstone).
        guild, script, _ = guild_and_script(actor, guild_id, script_id, "switch endpoints",
                                            lock=True)
        plan = resolve_plan(plans, guild.plan)
        endpoint = Endpoint.get(Endpoint.script == script.id)
        _refuse_stale(endpoint, expected_revision)
        if bool(endpoint.enabled) != enabled:
            if enabled:
                used = (Endpoint.select().join(Script)
                        .where((Script.guild == guild.id) & Script.deleted_at.is_null()
                               & Endpoint.enabled).count())
                if plan.endpoints == 0:   # as a test call on such a plan is refused
                    raise QuotaError(f"plan {plan.name} does not include endpoints",
                                     code="plan_feature")
                if used >= plan.endpoints:
                    raise QuotaError(
                        f"plan {plan.name} allows {plan.endpoints} enabled endpoint(s) and "
                        f"guild {guild.id} has {used}", code="endpoint_quota")
            Endpoint.update(enabled=enabled, enabled_at=utcnow() if enabled else endpoint.enabled_at
                            ).where(Endpoint.id == endpoint.id).execute()
            audit.record(actor, "endpoint.enabled" if enabled else "endpoint.disabled",
                         guild_id=guild.id, script_id=script.public_id, old=not enabled,
                         new=enabled)
        endpoint = Endpoint.get_by_id(endpoint.id)
    return _view(guild.id, script, endpoint, plan, base_url)


def enable_endpoint(actor: Actor, guild_id: str, script_id: str, **kw: Any) -> dict[str, Any]:
    """`set_enabled(..., True)`."""
    return set_enabled(actor, guild_id, script_id, True, **kw)


def disable_endpoint(actor: Actor, guild_id: str, script_id: str, **kw: Any) -> dict[str, Any]:
    """`set_enabled(..., False)`."""
    return set_enabled(actor, guild_id, script_id, False, **kw)


def set_whitelist(actor: Actor, guild_id: str, script_id: str, cidrs: Sequence[str], *,
                  plans: Mapping[str, Plan] = DEFAULT_PLANS,
                  base_url: str | None = None, expected_revision: str | None = None
                  ) -> dict[str, Any]:
    """Replace the IP whitelist (empty list: no restriction).  Raises
    `ValidationError` (`invalid_cidr`), `QuotaError` (`plan_feature`: not on
    this plan), `NotFoundError`, `PermissionDeniedError`, `VersionMismatchError`
    (not at `expected_revision`)."""
    normalised = normalise_cidrs(cidrs)
    with database.atomic():
        # The guild's row lock: two saves against one read must not both pass
        # the revision check (review, session 33).
        guild, script, _ = guild_and_script(actor, guild_id, script_id, "edit the whitelist",
                                            lock=True)
        plan = resolve_plan(plans, guild.plan)
        if normalised and not plan.ip_whitelist:
            raise QuotaError(f"plan {plan.name} does not include an IP whitelist (a stored one "
                             "is kept but not enforced; an empty list clears it)",
                             code="plan_feature")
        endpoint = Endpoint.get(Endpoint.script == script.id)
        _refuse_stale(endpoint, expected_revision)
        old = json.loads(endpoint.whitelist or "[]")
        if old != normalised:
            Endpoint.update(whitelist=json.dumps(normalised)).where(
                Endpoint.id == endpoint.id).execute()
            audit.record(actor, "whitelist.changed", guild_id=guild.id,
                         script_id=script.public_id, old=old, new=normalised)
        endpoint = Endpoint.get_by_id(endpoint.id)
    return _view(guild.id, script, endpoint, plan, base_url)
