"""Endpoint switch and quotas, downgrades, secrets, whitelist and the
invoke-path lookup, on SQLite and PostgreSQL."""
from __future__ import annotations

import ipaddress

import pytest

from models import AuditRecord, Guild
from service import core
from service.core.invoke_target import InvokeTarget, load_target
from service.core.secrets import verify_secret
from service.plans import DEFAULT_PLANS, Plan
from tests.factories import MANAGER, OPERATOR, OWNER, STRANGER, make_guild, make_script


def must_load(gid: str, sid: str, plans=DEFAULT_PLANS) -> InvokeTarget:
    target = load_target(gid, sid, plans)
    assert target is not None
    return target


@pytest.mark.parametrize("plan,quota", [("free", 0), ("plus", 3), ("pro", 9)])
def test_enable_within_quota(db, plan, quota):
    gid = make_guild(plan)
    sids = [make_script(gid, f"s{i}") for i in range(quota + 1)]
    for sid in sids[:quota]:
        assert core.enable_endpoint(MANAGER, gid, sid)["enabled"] is True
    with pytest.raises(core.QuotaError) as err:
        core.enable_endpoint(OWNER, gid, sids[quota])
    # A plan without endpoints says so (as its test calls do; docs/admin-api.md).
    assert err.value.code == ("endpoint_quota" if quota else "plan_feature")
    assert err.value.status == 409
    # Enabling an enabled endpoint is a no-op, not a second slot.
    if quota:
        core.enable_endpoint(OWNER, gid, sids[0])
    # Freeing a slot lets another in.
    if quota:
        core.disable_endpoint(OPERATOR, gid, sids[0])
        core.enable_endpoint(OWNER, gid, sids[quota])


def test_stranger_cannot_switch(db):
    gid = make_guild()
    sid = make_script(gid)
    with pytest.raises(core.NotFoundError) as err:      # a stranger learns nothing
        core.enable_endpoint(STRANGER, gid, sid)
    assert err.value.code == "guild_not_found"


def test_unknown_guild_and_script_are_not_found(db):
    gid = make_guild()
    with pytest.raises(core.NotFoundError) as err:
        core.show_endpoint(OWNER, "999", "logic_" + "a" * 22)
    assert err.value.code == "guild_not_found" and err.value.status == 404
    with pytest.raises(core.NotFoundError) as err:
        core.show_endpoint(OWNER, gid, "logic_" + "a" * 22)
    assert err.value.code == "script_not_found"


def test_downgrade_disables_newest_first_and_audits(db):
    gid = make_guild("pro")
    sids = [make_script(gid, f"s{i}") for i in range(5)]
    for sid in sids:
        core.enable_endpoint(OWNER, gid, sid)
    with pytest.raises(core.PermissionDeniedError):
        core.set_plan(OWNER, gid, "plus")
    result = core.set_plan(OPERATOR, gid, "plus")
    assert result["disabled"] == [sids[4], sids[3]]
    assert [core.show_endpoint(OWNER, gid, s)["enabled"] for s in sids] == [True] * 3 + [False] * 2
    audited = {(a.action, a.script_id) for a in AuditRecord.select()}
    assert ("endpoint.disabled", sids[4]) in audited and ("endpoint.disabled", sids[3]) in audited
    assert ("plan.changed", None) in audited
    assert core.set_plan(OPERATOR, gid, "free")["disabled"] == [sids[2], sids[1], sids[0]]
    assert core.show_guild(OWNER, gid)["endpointsEnabled"] == 0


def test_secret_owner_only(db):
    gid = make_guild()
    sid = make_script(gid)
    for actor in (OPERATOR, MANAGER):
        with pytest.raises(core.PermissionDeniedError) as err:
            core.regenerate_secret(actor, gid, sid)
        assert err.value.code == "owner_only" and err.value.status == 403
    with pytest.raises(core.NotFoundError) as nf:
        core.regenerate_secret(STRANGER, gid, sid)
    assert nf.value.code == "guild_not_found" and nf.value.status == 404
    first = core.regenerate_secret(OWNER, gid, sid)
    assert first["secret"].startswith("lsk_") and len(first["secret"]) == 4 + 43
    assert first["hint"] == first["secret"][-4:]
    shown = core.show_endpoint(MANAGER, gid, sid)
    assert shown["secret"]["hint"] == first["hint"] and "secret" not in str(shown["secret"].values())
    target = must_load(gid, sid)
    assert target is not None and verify_secret(target.secret_hash, first["secret"])
    second = core.regenerate_secret(OWNER, gid, sid)
    target = must_load(gid, sid)
    assert verify_secret(target.secret_hash, second["secret"])
    assert not verify_secret(target.secret_hash, first["secret"])
    assert not verify_secret(None, second["secret"]) and not verify_secret("garbage", "x")
    actions = [a.action for a in AuditRecord.select().where(AuditRecord.script_id == sid)
               .order_by(AuditRecord.id)]
    assert actions[-2:] == ["secret.created", "secret.regenerated"]


def test_a_secret_replaced_only_if_it_is_still_the_one_the_caller_saw(db):
    """`replaces`: a form sent twice, or two tabs, never kill a secret just shown."""
    gid = make_guild()
    sid = make_script(gid)
    with pytest.raises(core.ConflictError) as err:     # "a secret exists": there is none
        core.regenerate_secret(OWNER, gid, sid, replaces="2026-01-01T00:00:00.000Z")
    assert err.value.code == "secret_changed" and err.value.status == 409
    assert core.show_endpoint(OWNER, gid, sid)["secret"] is None
    first = core.regenerate_secret(OWNER, gid, sid, replaces="none")
    shown = core.show_endpoint(OWNER, gid, sid)["secret"]
    seen = f"{shown['createdAt']}/{shown['hint']}"
    second = core.regenerate_secret(OWNER, gid, sid, replaces=seen)
    for stale in ("none", seen):    # the same form again, or one from before the first
        with pytest.raises(core.ConflictError):
            core.regenerate_secret(OWNER, gid, sid, replaces=stale)
    target = must_load(gid, sid)
    assert verify_secret(target.secret_hash, second["secret"])
    assert not verify_secret(target.secret_hash, first["secret"])
    # The role check comes first: a stranger still learns nothing.
    with pytest.raises(core.NotFoundError):
        core.regenerate_secret(STRANGER, gid, sid, replaces="none")


def test_whitelist_pro_only_and_normalised(db):
    plus, pro = make_guild("plus"), make_guild("pro")
    s_plus, s_pro = make_script(plus), make_script(pro)
    with pytest.raises(core.QuotaError) as err:
        core.set_whitelist(OWNER, plus, s_plus, ["10.0.0.0/8"])
    assert err.value.code == "plan_feature"
    assert core.set_whitelist(OWNER, plus, s_plus, [])["whitelist"] == []
    view = core.set_whitelist(MANAGER, pro, s_pro,
                              ["2001:DB8::/32", "10.0.0.0/8", "192.0.2.7", "10.0.0.0/8", "::1"])
    assert view["whitelist"] == ["10.0.0.0/8", "192.0.2.7/32", "::1/128", "2001:db8::/32"]
    target = must_load(pro, s_pro)
    assert ipaddress.ip_network("2001:db8::/32") in target.whitelist


@pytest.mark.parametrize("bad", ["10.0.0.1/8", "300.1.1.1", "10.0.0.0/33", "fe80::1/200", "nope", ""])
def test_invalid_cidr_is_refused(db, bad):
    gid = make_guild("pro")
    sid = make_script(gid)
    with pytest.raises(core.ValidationError) as err:
        core.set_whitelist(OWNER, gid, sid, ["192.0.2.0/24", bad])
    assert err.value.code == "invalid_cidr" and repr(bad.strip()) in err.value.message
    if bad == "10.0.0.1/8":
        assert "did you mean 10.0.0.0/8" in err.value.message
    assert core.show_endpoint(OWNER, gid, sid)["whitelist"] == []


@pytest.mark.parametrize("zone", ["fe80::1%eth0", "fe80::1%two words/128", "::%" + "z" * 2000,
                                  "fe80::1%`**bold**`/128", "fe80::1%a\nb"])
def test_an_ipv6_zone_is_refused_and_never_echoed_whole(db, zone):
    # Review, session 25: Python takes any text after "%" as a zone id; it
    # matched nothing more, was stored and shown in chat replies, audit and
    # pages, and the dashboard could not save the list back.
    gid = make_guild("pro")
    sid = make_script(gid)
    with pytest.raises(core.ValidationError) as err:
        core.set_whitelist(OWNER, gid, sid, ["fe80::/64", zone])
    assert err.value.code == "invalid_cidr" and "zone ids" in err.value.message
    assert len(err.value.message) < 200
    assert core.show_endpoint(OWNER, gid, sid)["whitelist"] == []


def test_load_target(db):
    gid = make_guild("plus")
    sid = make_script(gid)
    assert load_target(gid, "logic_" + "b" * 22) is None
    assert load_target("999", sid) is None
    assert load_target("not-digits", sid) is None
    target = must_load(gid, sid)
    assert target.enabled is False and target.script_version == 1 and target.secret_hash is None
    assert target.plan == DEFAULT_PLANS["plus"] and target.whitelist == ()
    core.enable_endpoint(OWNER, gid, sid)
    assert must_load(gid, sid).enabled is True
    # A guild put on a plan without endpoints behind the service's back:
    Guild.update(plan="free").where(Guild.id == gid).execute()
    assert must_load(gid, sid).enabled is False
    # Operator-defined plans come from the settings mapping.
    custom = {"free": DEFAULT_PLANS["free"], "bench": Plan("bench", 9, 4096, 10**6, 1 << 20, 200,
                                                           True, True, True, 1000)}
    Guild.update(plan="bench").where(Guild.id == gid).execute()
    assert must_load(gid, sid, custom).plan.requests_per_minute == 10**6
    core.delete_script(OWNER, gid, sid)
    assert load_target(gid, sid) is None


def test_racing_enables_cannot_pass_the_quota(db):
    """Two requests for the last slot at once: exactly one wins."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    gid = make_guild("plus")
    sids = [make_script(gid, f"s{i}") for i in range(4)]
    for sid in sids[:2]:
        core.enable_endpoint(OWNER, gid, sid)
    barrier = threading.Barrier(2)

    def enable(sid: str) -> str:
        barrier.wait()
        try:
            core.enable_endpoint(MANAGER, gid, sid)
            return "ok"
        except core.QuotaError:
            return "quota"
        finally:
            db.close()

    for _ in range(3):
        with ThreadPoolExecutor(max_workers=2) as pool:
            results = sorted(pool.map(enable, sids[2:]))
        assert results == ["ok", "quota"]
        assert core.show_guild(OWNER, gid)["endpointsEnabled"] == 3
        enabled = [s for s in sids[2:] if core.show_endpoint(OWNER, gid, s)["enabled"]]
        core.disable_endpoint(OWNER, gid, enabled[0])
