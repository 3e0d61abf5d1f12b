"""What the script page says about the plan is what the plan does: a whitelist kept
after a downgrade is said not to be enforced (and is not), and the charts, being
advanced statistics, appear only on plans that include them."""
from __future__ import annotations

import re

from tests.service.dashboard.conftest import OWNER, Client, Site

SOURCE = 'on endpoint(event):\n    event.reply({"ok": True})\n'


def test_a_whitelist_kept_after_a_downgrade_is_said_not_enforced(
        site: Site, client: Client) -> None:
    from service import core
    gid = site.guild("pro")
    sid = site.script(gid, SOURCE)
    secret = site.enable_with_secret(gid, sid)
    core.set_whitelist(core.Actor.user(OWNER), gid, sid, ["10.9.8.0/24"], plans=site.plans)
    assert site.invoke(gid, sid, secret, {}).code == "ip_not_allowed"
    core.set_plan(core.Actor.operator(), gid, "plus", plans=site.plans)
    client.login(site.link(OWNER))
    text = client.get(f"/dashboard/{gid}/scripts/{sid}").body.decode()
    assert "still enforced" not in text
    assert "kept but not enforced on this plan" in text and "You can clear it" in text
    assert "10.9.8.0/24" in text
    # What the page says is what happens: a caller outside the list is answered.
    assert site.invoke(gid, sid, secret, {}).status == 200


def test_charts_only_on_plans_with_advanced_statistics(site: Site, client: Client) -> None:
    client.login(site.link(OWNER))
    shown = {}
    for plan in ("plus", "pro"):
        gid = site.guild(plan)
        sid = site.script(gid, SOURCE)
        secret = site.enable_with_secret(gid, sid)
        assert site.invoke(gid, sid, secret, {}).status == 200
        shown[plan] = client.get(f"/dashboard/{gid}/scripts/{sid}").body.decode()
    plus, pro = shown["plus"], shown["pro"]
    assert '<svg class="chart"' not in plus and "Requests per minute" not in plus
    assert "Requests per hour" not in plus
    assert "Charts per minute and per hour, latency percentiles and top callers come with" in plus
    assert len(re.findall(r'<svg class="chart"', pro)) == 2
    assert "Requests per minute, last hour" in pro and "Top caller addresses" in pro
