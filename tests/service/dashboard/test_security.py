"""The dashboard's security properties over real HTTP (no browser needed):
session cookie flags, headers on every page, XSRF, one-time links, roles, and
untrusted record content rendered inert."""
from __future__ import annotations

import re
import time
from pathlib import Path
import pytest

from tests.service.dashboard.conftest import (MANAGER, OWNER, STRANGER, Client, Site,
                                              start_site)
from tests.service.http.harness import wait_until

SOURCE = '''\
on endpoint(event):
    print("got", event.body)
    event.reply({"ok": True})
'''
HOSTILE = '''\
on endpoint(event):
    print("<script>window.pwned = 1</script>")
    event.header("Content-Type", "text/html")
    event.reply("<script>window.pwned = 2</script><img src=x onerror=alert(1)>")
'''


def csp_ok(headers: dict[str, str]) -> None:
    csp = headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert headers["x-frame-options"] == "DENY"
    assert headers["x-content-type-options"] == "nosniff"


def session_cookie(raw: list[tuple[str, str]]) -> str:
    found = [v for k, v in raw if k.lower() == "set-cookie" and v.startswith("logic_session=")]
    assert len(found) == 1, raw
    return found[0]


def test_login_sets_a_signed_httponly_lax_cookie_and_leaves_no_token_in_the_url(
        site: Site, client: Client) -> None:
    resp = client.login(site.link(OWNER))
    cookie = session_cookie(resp.raw_headers)
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Path=/" in cookie
    assert "Secure" not in cookie          # base_url is http here
    assert "expires" not in cookie.lower()  # a browser-session cookie; the server times it out
    assert resp.headers["location"] == "/dashboard"
    assert resp.headers["referrer-policy"] == "no-referrer"
    # The cookie is signed: changing one character of it is no session.
    name, _, value = cookie.split(";", 1)[0].partition("=")
    forged = Client(site.server, {name: value[:-3] + ("0" if value[-3] != "0" else "1") + value[-2:]})
    assert forged.get("/dashboard").status == 303


@pytest.mark.parametrize("base_url", ["https://logic.example.com", "HTTPS://logic.example.com",
                                      "Https://logic.example.com/"])
def test_cookie_is_secure_when_the_base_url_is_https(tmp_path: Path, base_url: str) -> None:
    # The scheme in any letter case is https: a cookie without Secure would
    # also be sent over plain http to the same host.
    s = start_site(tmp_path, env={"LOGIC_SERVER_BASE_URL": base_url})
    try:
        resp = Client(s.server).get(s.link(OWNER))
        assert resp.status == 303
        assert "Secure" in session_cookie(resp.raw_headers)
    finally:
        s.server.stop()
        s.db.close()


def test_every_dashboard_page_carries_the_security_headers(site: Site, client: Client) -> None:
    gid = site.guild()
    sid = site.script(gid, SOURCE)
    anonymous = Client(site.server)
    pages: list[tuple[Client, str, int]] = [
        (anonymous, "/login", 200), (anonymous, "/login/not-a-real-token", 400),
        (anonymous, "/dashboard", 303), (anonymous, "/dashboard/static/dashboard.js", 200),
        (anonymous, "/dashboard/static/dashboard.css", 200),
    ]
    for c, path, status in pages:
        resp = c.get(path)
        assert resp.status == status, path
        csp_ok(resp.headers)
    client.login(site.link(OWNER))
    for path, status in [("/dashboard", 200), (f"/dashboard/{gid}", 200),
                         (f"/dashboard/{gid}/scripts/{sid}", 200),
                         (f"/dashboard/{gid}/scripts/{sid}?tab=source", 200),
                         ("/dashboard/99999999", 404)]:
        resp = client.get(path)
        assert resp.status == status, path
        csp_ok(resp.headers)
        assert resp.headers["cache-control"] == "no-store"
        # No inline script anywhere: every <script> has a src on our origin.
        text = resp.body.decode()
        assert all(re.search(r'src="/dashboard/static/', tag) for tag in re.findall(r"<script[^>]*>", text))
        assert re.findall(r"<[a-z]+ [^>]*\son[a-z]+=", text) == []      # no inline handlers
    resp = client.post(f"/dashboard/{gid}/scripts/{sid}/endpoint", {"enabled": "on", "_xsrf": "x"})
    assert resp.status == 403
    csp_ok(resp.headers)
    # A form too large for any handler is answered by the connection itself: its
    # JSON error runs nothing, is never framed, never cached.
    resp = client.post(f"/dashboard/{gid}/scripts/{sid}/endpoint",
                       {"enabled": "on", "_xsrf": client.xsrf(), "pad": "a" * 2_000_000})
    assert resp.status == 413
    assert "default-src 'none'" in resp.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in resp.headers["content-security-policy"]
    assert resp.headers["x-frame-options"] == "DENY"
    assert resp.headers["x-content-type-options"] == "nosniff"
    assert resp.headers["cache-control"] == "no-store"


def test_unrouted_dashboard_paths_answer_as_the_dashboard(site: Site, client: Client) -> None:
    anonymous = Client(site.server)
    client.login(site.link(OWNER))
    for c in (anonymous, client):
        for path in ("/dashboard/x", "/dashboard/111/", "/dashboard/111/scripts/nope",
                     "/dashboard/static/missing.css"):
            resp = c.get(path)
            assert resp.status == 404, path
            csp_ok(resp.headers)
            assert resp.headers["cache-control"] == "no-store", path
            assert resp.headers["content-type"].startswith("text/html"), path
        # A link no token can be (too long, other characters) is refused like a used one.
        for path in ("/login/" + "a" * 101, "/login/a.b", "/login/"):
            resp = c.get(path)
            assert resp.status == 400, path
            csp_ok(resp.headers)
            assert resp.headers["cache-control"] == "no-store"
            assert "This login link is invalid, already used or expired" in resp.body.decode()
    assert "a" * 101 not in site.server.log


def test_static_files_carry_the_headers_and_a_stated_cache_policy(site: Site) -> None:
    anonymous = Client(site.server)
    page = anonymous.get("/login").body.decode()
    linked = re.findall(r'(?:href|src)="(/dashboard/static/[^"]+\?v=[0-9]+)"', page)
    assert linked, page[:500]
    for path in linked:                    # the versioned URLs the pages link: cached
        resp = anonymous.get(path)
        assert resp.status == 200
        csp_ok(resp.headers)
        assert resp.headers["cache-control"] == "max-age=315360000", path
    for path in ("/dashboard/static/dashboard.js", "/dashboard/static/dashboard.css"):
        resp = anonymous.get(path)             # no version: revalidated each time
        assert resp.status == 200 and resp.headers["cache-control"] == "no-cache", path
        csp_ok(resp.headers)
        assert resp.headers["etag"]


def test_a_used_or_expired_link_is_refused(site: Site) -> None:
    from datetime import timedelta
    link = site.link(OWNER)
    Client(site.server).login(link)
    again = Client(site.server).get(link)
    assert again.status == 400 and b"invalid, already used or expired" in again.body
    assert not any(k.lower() == "set-cookie" for k, _ in again.raw_headers)
    expired = Client(site.server).get(site.link(OWNER, ttl=timedelta(seconds=-1)))
    assert expired.status == 400


def test_a_link_of_another_user_asks_before_it_replaces_a_live_session(site: Site) -> None:
    # Login CSRF: any site can make a browser open a link, and any guild owner
    # can get one for himself; opened at once it would end the victim's session
    # and have them work, unknowing, in the other account.
    victim = Client(site.server)
    victim.login(site.link(OWNER))
    kept = dict(victim.cookies)
    theirs = site.link(STRANGER)
    page = victim.get(theirs)
    assert page.status == 200 and b"Log in as another user?" in page.body
    assert not any(k.lower() == "set-cookie" for k, _ in page.raw_headers)
    assert victim.cookies == kept and b"User " + OWNER.encode() in victim.get("/dashboard").body
    # Only this session's own form switches: no token, a forged one, or a
    # cross-site POST (no cookie under SameSite=Lax) is refused, link unused.
    for form, who in (({}, victim), ({"_xsrf": "forged"}, victim),
                      ({"_xsrf": victim.xsrf()}, Client(site.server))):
        resp = who.post(theirs, form)
        assert resp.status == 403 and not any(k.lower() == "set-cookie"
                                               for k, _ in resp.raw_headers)
    assert b"User " + OWNER.encode() in victim.get("/dashboard").body
    resp = victim.post(theirs, {"_xsrf": victim.xsrf()})
    assert resp.status == 303 and resp.headers["location"] == "/dashboard"
    assert b"User " + STRANGER.encode() in victim.get("/dashboard").body
    assert Client(site.server, kept).get("/dashboard").status == 303   # the old session ended
    assert Client(site.server).get(theirs).status == 400               # and the link is spent
    # The user's own new link still replaces the session at once; a spent link
    # leaves it as it was.
    victim.login(site.link(STRANGER))
    assert victim.get(theirs).status == 400
    assert b"User " + STRANGER.encode() in victim.get("/dashboard").body


def test_state_changes_need_the_session_bound_xsrf_token(site: Site, client: Client) -> None:
    gid = site.guild()
    sid = site.script(gid, SOURCE)
    page = f"/dashboard/{gid}/scripts/{sid}"
    client.login(site.link(OWNER))
    other = Client(site.server)
    other.login(site.link(OWNER))
    theirs = other.xsrf()
    for token in (None, "", "forged", theirs):
        form = {"enabled": "on"} if token is None else {"enabled": "on", "_xsrf": token}
        resp = client.post(f"{page}/endpoint", form)
        assert resp.status == 403 and b"XSRF" in resp.body, token
    assert b"Enable endpoint" in client.get(page).body          # still off
    mine = client.xsrf()
    assert client.post(f"{page}/endpoint", {"enabled": "on", "_xsrf": mine}).status == 303
    assert b"Disable endpoint" in client.get(page).body
    # Logout needs it too; without a session a POST is refused outright.
    assert client.post("/logout", {"_xsrf": "forged"}).status == 403
    assert Client(site.server).post("/logout", {"_xsrf": mine}).status == 403


def test_roles_manager_has_no_secret_button_and_a_stranger_gets_404(site: Site) -> None:
    gid = site.guild()
    sid = site.script(gid, SOURCE)
    page = f"/dashboard/{gid}/scripts/{sid}"
    owner, manager, stranger = Client(site.server), Client(site.server), Client(site.server)
    owner.login(site.link(OWNER))
    manager.login(site.link(MANAGER))
    stranger.login(site.link(STRANGER))
    assert b'id="secret-button"' in owner.get(page).body
    body = manager.get(page).body
    assert manager.last is not None and manager.last.status == 200
    assert b'id="secret-button"' not in body and f"user {OWNER}) can create".encode() in body
    resp = manager.post(f"{page}/secret", {"_xsrf": manager.xsrf(), "confirm": "yes"},
                        headers={"Accept": "application/json"})
    assert resp.status == 403
    # Managers may not add managers either; the owner may.
    assert manager.post(f"/dashboard/{gid}/managers", {"action": "add", "user_id": "77",
                                                      "_xsrf": manager.xsrf()}).status == 403
    assert owner.post(f"/dashboard/{gid}/managers", {"action": "add", "user_id": "77",
                                                    "_xsrf": owner.xsrf()}).status == 303
    assert b"user 77" in owner.get(f"/dashboard/{gid}").body
    # A stranger learns nothing: the same 404 as for a guild that does not exist.
    missing = stranger.get("/dashboard/123456789")
    for path in (f"/dashboard/{gid}", page, f"{page}?tab=source"):
        resp = stranger.get(path)
        assert resp.status == 404 and resp.body == missing.body.replace(
            missing.headers["x-request-id"].encode(), resp.headers["x-request-id"].encode())
    token = stranger.xsrf()
    from service import core
    site.bind()       # a save naming the right revision: the role check is what refuses it
    revision = core.scripts.revision(core.show_script(core.Actor.user(OWNER), gid, sid))
    for path, form in ((f"{page}/secret", {}), (f"{page}/endpoint", {"enabled": "on"}),
                       (f"{page}/whitelist", {"cidrs": ""}),
                       (f"{page}/source", {"source": SOURCE + "# x\n", "revision": revision}),
                       (f"/dashboard/{gid}/managers", {"action": "add", "user_id": "1"})):
        assert stranger.post(path, {**form, "_xsrf": token}).status == 404, path
    assert b"Guild " + gid.encode() not in stranger.get("/dashboard").body
    assert core.show_script(core.Actor.user(OWNER), gid, sid)["version"] == 1


def test_script_replies_and_output_render_as_text(site: Site, client: Client) -> None:
    gid = site.guild()
    sid = site.script(gid, HOSTILE)
    secret = site.enable_with_secret(gid, sid)
    resp = site.invoke(gid, sid, secret, {"a": "<script>window.pwned = 3</script>"})
    assert resp.status == 200 and resp.body.startswith(b"<script>")
    client.login(site.link(OWNER))
    page = f"/dashboard/{gid}/scripts/{sid}"
    assert wait_until(lambda: b"record-" in client.get(page).body, timeout=15)
    text = client.get(page).body.decode()
    assert "<script>window.pwned" not in text and "<img src=x" not in text
    assert "&lt;script&gt;window.pwned = 2&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;" in text
    assert "&lt;script&gt;window.pwned = 1&lt;/script&gt;" in text      # print output
    assert "window.pwned = 3" in text and "<script>window.pwned = 3" not in text   # request body


def test_a_huge_body_renders_cut_and_fast(site: Site, client: Client) -> None:
    source = "on endpoint(event):\n    event.reply(event.rawBody)\n"
    gid = site.guild()
    sid = site.script(gid, source)
    secret = site.enable_with_secret(gid, sid)
    big = "<b>" + "x" * 900_000
    resp = site.server.request(f"/endpoints/{gid}/{sid}", secret=secret, body=big,
                               headers={"Content-Type": "text/plain"})
    assert resp.status == 200
    client.login(site.link(OWNER))
    page = f"/dashboard/{gid}/scripts/{sid}"
    assert wait_until(lambda: b"record-" in client.get(page).body, timeout=15)
    text = client.get(page).body.decode()
    assert "<b>xxx" not in text and "&lt;b&gt;xxx" in text
    # Each body is shown cut to 64 KiB with a note; the page stays small.
    assert "showing the first 65536" in text or "truncated when stored" in text
    assert len(text) < 400_000


def test_history_comes_a_page_at_a_time(site: Site, client: Client) -> None:
    # Review, session 25: every kept record was rendered in full, 200 of them
    # at the stored caps made a 20 MB page on each view.
    import re
    source = "on endpoint(event):\n    event.reply(event.rawBody)\n"
    gid = site.guild()
    sid = site.script(gid, source)
    secret = site.enable_with_secret(gid, sid)
    for i in range(60):
        body = f"request-{i:03d} " + "y" * 60_000
        assert site.server.request(f"/endpoints/{gid}/{sid}", secret=secret, body=body,
                                   headers={"Content-Type": "text/plain"}).status == 200
    client.login(site.link(OWNER))
    page = f"/dashboard/{gid}/scripts/{sid}"
    assert wait_until(lambda: b"request-059" in client.get(page).body, timeout=15)
    seen: list[str] = []
    text = client.get(page).body.decode()
    for _ in range(5):
        shown = re.findall(r"request-(\d{3}) y", text)
        assert 0 < len(set(shown)) <= 25 and len(text) < 4_000_000
        seen += sorted(set(shown), reverse=True)
        older = re.search(r'href="\?history=([^"#]+)#history">Older requests', text)
        if older is None:
            break
        text = client.get(f"{page}?history={older.group(1)}").body.decode()
    assert seen == [f"{i:03d}" for i in range(59, -1, -1)]   # newest first, each once
    # A cursor that is none shows the newest page; one past what is kept says
    # so, with the way back (it showed "No requests yet" before).
    assert "request-059" in client.get(f"{page}?history=%00nonsense").body.decode()
    from service.core.pages import encode_cursor
    past = client.get(f"{page}?history={encode_cursor(1)}").body.decode()
    assert "No older requests are kept" in past and "No requests yet" not in past
    assert ">Newest requests</a>" in past


def test_logout_ends_the_session_and_the_operator_can_end_them_all(site: Site) -> None:
    import subprocess

    from tests.service.http.harness import LOGIC
    a, b, c = Client(site.server), Client(site.server), Client(site.server)
    user = "9191"      # a user of its own: other tests' sessions do not count here
    for x in (a, b, c):
        x.login(site.link(user if x is not c else MANAGER))
    old_cookie = dict(a.cookies)
    resp = a.post("/logout", {"_xsrf": a.xsrf()})
    assert resp.status == 200 and b"You are logged out" in resp.body
    assert "logic_session" not in a.cookies
    # The old cookie is dead on the server too, not only forgotten by the browser.
    assert Client(site.server, old_cookie).get("/dashboard").status == 303
    assert b.get("/dashboard").status == 200
    out = subprocess.run([LOGIC, "--database-url", site.server.database_url, "session", "end",
                          user], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"ended 1 session(s) of user {user}"
    resp = b.get("/dashboard")
    assert resp.status == 303 and resp.headers["location"] == "/login"
    assert c.get("/dashboard").status == 200       # another user's session lives on
    bad = subprocess.run([LOGIC, "--database-url", site.server.database_url, "session", "end",
                          "bad id"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


@pytest.mark.parametrize("plan", ["plus"])
def test_whitelist_is_refused_with_the_plan_named_on_plans_without_it(
        site: Site, client: Client, plan: str) -> None:
    gid = site.guild(plan)
    sid = site.script(gid, SOURCE)
    client.login(site.link(OWNER))
    page = f"/dashboard/{gid}/scripts/{sid}"
    text = client.get(page).body.decode()
    assert "The IP whitelist is part of the pro plan; this guild is on plus." in text
    assert re.search(r'<textarea id="cidrs"[^>]*disabled', text, re.S)
    resp = client.post(f"{page}/whitelist", {"cidrs": "10.0.0.0/8", "_xsrf": client.xsrf()})
    assert resp.status == 409 and b"does not include an IP whitelist" in resp.body



def test_a_whitelist_form_from_an_older_page_does_not_undo_a_newer_change(
        site: Site, client: Client) -> None:
    # Review, session 33: the form sent only the CIDRs, so a manager's page
    # loaded before the owner removed a range put the range back, silently.
    from service import core
    gid = site.guild("pro")
    sid = site.script(gid, SOURCE)
    site.bind()
    owner = core.Actor.user(OWNER)
    core.set_whitelist(owner, gid, sid, ["10.0.0.0/8", "192.0.2.0/24"], plans=site.plans)
    client.login(site.link(MANAGER))
    page = f"/dashboard/{gid}/scripts/{sid}"
    shown = client.get(page).body.decode()
    old = re.search(r'name="revision" value="([0-9a-f]+)"\s*>\s*<label for="cidrs"', shown)
    assert old, shown[:300]
    core.set_whitelist(owner, gid, sid, ["10.0.0.0/8"], plans=site.plans)   # elsewhere
    stale = {"cidrs": "10.0.0.0/8\n192.0.2.0/24\n198.51.100.0/24", "_xsrf": client.xsrf()}
    # A typo first: its page keeps saying what the first page showed, so the
    # save after the fix is still one from the older page.
    typo = client.post(f"{page}/whitelist", {**stale, "cidrs": stale["cidrs"] + "\n10.0.0.1/8",
                                             "revision": old.group(1)})
    assert typo.status == 400 and "did you mean 10.0.0.0/8" in typo.body.decode()
    assert f'name="revision" value="{old.group(1)}"' in typo.body.decode()
    for form in ({**stale, "revision": old.group(1)}, stale):       # older page; none named
        resp = client.post(f"{page}/whitelist", form)
        text = resp.body.decode()
        assert resp.status == 409 and "changed elsewhere after this page was loaded; " \
            "its whitelist is now 10.0.0.0/8. Your text is kept" in text, text[:300]
        assert "198.51.100.0/24</textarea>" in text                  # the text typed stays
        assert core.show_endpoint(owner, gid, sid)["whitelist"] == ["10.0.0.0/8"]
    # Saving again from the page that showed the conflict replaces it.
    now = re.search(r'name="revision" value="([0-9a-f]+)"\s*>\s*<label for="cidrs"', text)
    assert now and now.group(1) != old.group(1)
    resp = client.post(f"{page}/whitelist", {**stale, "revision": now.group(1)})
    assert resp.status == 303
    assert core.show_endpoint(owner, gid, sid)["whitelist"] == [
        "10.0.0.0/8", "192.0.2.0/24", "198.51.100.0/24"]


def test_quota_refusal_names_the_numbers_and_the_owner_removes_managers(
        site: Site, client: Client) -> None:
    gid = site.guild("plus")
    sids = [site.script(gid, SOURCE, name=f"s{i}") for i in range(4)]
    for sid in sids[:3]:
        site.enable_with_secret(gid, sid)
    client.login(site.link(OWNER))
    page = f"/dashboard/{gid}/scripts/{sids[3]}"
    resp = client.post(f"{page}/endpoint", {"enabled": "on", "_xsrf": client.xsrf()})
    text = resp.body.decode()
    assert resp.status == 409
    assert f"plan plus allows 3 enabled endpoint(s) and guild {gid} has 3" in text
    assert "Enable endpoint" in text                     # still off
    assert client.post(f"/dashboard/{gid}/managers", {"action": "remove", "user_id": MANAGER,
                                                     "_xsrf": client.xsrf()}).status == 303
    assert f"user {MANAGER}" not in client.get(f"/dashboard/{gid}").body.decode()
    resp = client.post(f"/dashboard/{gid}/managers", {"action": "remove", "user_id": MANAGER,
                                                     "_xsrf": client.xsrf()})
    assert resp.status == 400 and b"is not a manager" in resp.body


def test_a_new_cookie_secret_ends_every_session(tmp_path: Path) -> None:
    first = start_site(tmp_path, env={"LOGIC_SERVER_COOKIE_SECRET": "a" * 40})
    user = Client(first.server)
    try:
        user.login(first.link(OWNER))
        assert user.get("/dashboard").status == 200
    finally:
        first.server.stop()
        first.db.close()
    second = start_site(tmp_path, env={"LOGIC_SERVER_COOKIE_SECRET": "b" * 40})
    try:
        user.server = second.server
        resp = user.get("/dashboard")
        assert resp.status == 303 and resp.headers["location"] == "/login"
    finally:
        second.server.stop()
        second.db.close()


def test_the_console_sends_a_text_body_and_the_editor_saves_source_as_typed(
        site: Site, client: Client) -> None:
    # Tornado strips a form argument's surrounding whitespace by default: a
    # save lost the source's final newline, a text test body its spaces.
    from service import core
    echo = "on endpoint(event):\n    event.reply({'body': event.body})\n"
    gid = site.guild("pro")
    sid = site.script(gid, SOURCE)
    client.login(site.link(OWNER))
    page = f"/dashboard/{gid}/scripts/{sid}"
    site.bind()       # the editor form carries the revision it was opened on
    revision = core.scripts.revision(core.show_script(core.Actor.user(OWNER), gid, sid))
    resp = client.post(f"{page}/source", {"source": echo.replace("\n", "\r\n"),
                                          "revision": revision, "_xsrf": client.xsrf()})
    assert resp.status == 303
    site.bind()
    assert core.show_script(core.Actor.user(OWNER), gid, sid)["source"] == echo
    resp = client.post(f"{page}/test", {"body": "  two spaces\n", "kind": "text",
                                        "_xsrf": client.xsrf()})
    assert resp.status == 200
    assert b"  two spaces\\n" in resp.body, resp.body[-3000:]


def test_console_refusals_are_explained_and_strangers_learn_nothing(site: Site, client: Client) -> None:
    gid = site.guild("pro")
    sid = site.script(gid, SOURCE)
    free = site.guild("free")
    free_sid = site.script(free, SOURCE)
    client.login(site.link(OWNER))
    page = f"/dashboard/{gid}/scripts/{sid}"
    resp = client.post(f"{page}/replay", {"request_id": "req_nope", "_xsrf": client.xsrf()})
    assert resp.status == 400 and b"Not replayed: request req_nope not found" in resp.body
    resp = client.post(f"{page}/test", {"method": "GET", "body": "", "kind": "text",
                                        "_xsrf": client.xsrf()})
    assert resp.status == 400 and b"Not sent: the invoke path runs POST requests only" in resp.body
    # Second review, session 28: the console decoded a JSON body before
    # anything counted its values (the invoke path's cap).
    many = "[" + ",".join(["[]"] * 60_000) + "]"
    resp = client.post(f"{page}/test", {"body": many, "kind": "json", "_xsrf": client.xsrf()})
    assert b"Not sent: the JSON body holds more than 50,000 values." in resp.body
    resp = client.post(f"{page}/test", {"body": "[" * 5000, "kind": "json",
                                        "_xsrf": client.xsrf()})
    assert resp.status == 400 and b"Not sent: the JSON body is nested too deeply" in resp.body
    resp = client.post(f"/dashboard/{free}/scripts/{free_sid}/test",
                       {"body": "{}", "kind": "json", "_xsrf": client.xsrf()})
    assert resp.status == 400 and b"does not include endpoints" in resp.body
    stranger = Client(site.server)
    stranger.login(site.link(STRANGER))
    for path in (f"{page}/replay", f"{page}/test"):
        assert stranger.post(path, {"request_id": "req_nope", "body": "{}",
                                    "_xsrf": stranger.xsrf()}).status == 404


def test_a_secret_needs_confirmation_and_is_shown_once(site: Site, client: Client) -> None:
    gid = site.guild("pro")
    sid = site.script(gid, SOURCE)
    first = site.enable_with_secret(gid, sid)
    client.login(site.link(OWNER))
    page = f"/dashboard/{gid}/scripts/{sid}"
    # A bare POST (a resubmitted form, a click without the dialog) changes nothing.
    resp = client.post(f"{page}/secret", {"_xsrf": client.xsrf()})
    assert resp.status == 400 and b"Confirm first" in resp.body
    assert site.invoke(gid, sid, first, {}).status == 200
    # Without script: the checkbox confirms, and a page shows the secret once.
    # The form names the secret it replaces (the page's hidden field).
    replaces = re.search(r'name="replaces" id="secret-replaces" value="([^"]+)"',
                         client.get(page).body.decode())
    assert replaces and replaces.group(1) != "none"
    form = {"_xsrf": client.xsrf(), "confirm": "yes", "replaces": replaces.group(1)}
    resp = client.post(f"{page}/secret", form)
    assert resp.status == 201
    secret = re.search(r'value="(lsk_[^"]+)"', resp.body.decode())
    assert secret and site.invoke(gid, sid, secret.group(1), {}).status == 200
    assert site.invoke(gid, sid, first, {}).status == 401
    shown = client.get(page).body.decode()
    assert secret.group(1) not in shown and f"…{secret.group(1)[-4:]}" in shown
    # The same form sent again (a reload of the page that showed the secret)
    # finds another secret: 409, no new one, and the one just shown still works.
    again = client.post(f"{page}/secret", form)
    assert again.status == 409 and b"lsk_" not in again.body
    assert site.invoke(gid, sid, secret.group(1), {}).status == 200
    # Without the field (a form from before): nothing changes either.
    resp = client.post(f"{page}/secret", {"_xsrf": client.xsrf(), "confirm": "yes"})
    assert resp.status == 400 and site.invoke(gid, sid, secret.group(1), {}).status == 200


def test_a_managers_flood_of_slow_saves_never_holds_another_users_page(site: Site) -> None:
    """The dashboard's two service-layer threads are shared by user in turns
    (`service.http.fair`): one user's slow saves hold one thread at most."""
    import threading
    import time

    from tests.service.api.test_fair_calls import _slow_source

    from service import core
    attacked, other = site.guild(), site.guild(managers=())
    # One script per save: each form carries its own script's revision, so
    # all four are saved (as four editor tabs would).
    sids = [site.script(attacked, SOURCE, name=f"scores{n}") for n in range(4)]
    revisions = [core.scripts.revision(core.show_script(core.Actor.user(OWNER), attacked, sid))
                 for sid in sids]
    manager = Client(site.server)
    manager.login(site.link(MANAGER))
    token = manager.xsrf()
    owner = Client(site.server)
    owner.login(site.link(OWNER))
    finished: list[float] = []
    statuses: list[int] = []

    def save(seed: int) -> None:
        resp = Client(site.server, dict(manager.cookies)).post(
            f"/dashboard/{attacked}/scripts/{sids[seed]}/source",
            {"source": _slow_source(seed), "revision": revisions[seed], "_xsrf": token})
        finished.append(time.monotonic())
        statuses.append(resp.status)

    flood = [threading.Thread(target=save, args=(seed,)) for seed in range(4)]
    for thread in flood:
        thread.start()
    time.sleep(0.15)   # the saves have arrived (each takes the compile check 0.5-1 s)
    page = owner.get(f"/dashboard/{other}")
    at = time.monotonic()
    for thread in flood:
        thread.join(120)
    assert page.status == 200 and f"Guild {other}".encode() in page.body
    assert statuses == [303] * 4, statuses
    # Without the turns, first come first served on two threads, the page waited
    # for at least two of the four saves.
    assert sum(1 for t in finished if t < at) == 0, (sorted(finished), at)


def test_anonymous_login_floods_never_turn_a_signed_in_user_away(site: Site) -> None:
    """Calls made before a session is known (resuming one, logging in) are no
    user's turn: 40 connections spending random login links from the user's own
    address slow the dashboard, never answer the user's pages 503."""
    import secrets as random_tokens
    import threading

    site.guild()
    owner = Client(site.server)
    owner.login(site.link(OWNER))
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            site.server.request_from("127.0.0.1", "/login/" + random_tokens.token_urlsafe(32),
                                     method="GET")

    flood = [threading.Thread(target=hammer) for _ in range(40)]
    for thread in flood:
        thread.start()
    try:
        statuses = [owner.get("/dashboard").status for _ in range(30)]
    finally:
        stop.set()
        for thread in flood:
            thread.join(30)
    assert statuses == [200] * 30, statuses


def _raw_get(site: Site, target: bytes, headers: bytes = b"") -> tuple[int, bytes]:
    """A GET whose request line is sent as it is (no client-side quoting)."""
    import socket
    with socket.create_connection(("127.0.0.1", site.server.port), timeout=30) as sock:
        sock.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     + headers + b"\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def test_hostile_static_paths_are_the_dashboards_404_and_leave_no_log_line(site: Site) -> None:
    # Security review, session 16: a NUL in the name was a Tornado 500 with an
    # ERROR traceback quoting the URI; `..%2f` plus 60 KB logged a WARNING
    # quoting the path twice, per request (13-15 MB/s of log from one client).
    before = len(site.server.log_lines)
    marker = "hostile-static-" + "z" * 40
    for target in (b"/dashboard/static/%00?x=" + marker.encode(),
                   b"/dashboard/static/..%2f" + marker.encode(),
                   b"/dashboard/static/../../models/db.py?" + marker.encode(),
                   b"/dashboard/static/%2e%2e/templates/error.html",
                   b"/dashboard/static/" + marker.encode() * 200):
        status, data = _raw_get(site, target)
        head, _, body = data.partition(b"\r\n\r\n")
        assert status == 404, (target, data[:300])
        assert b"text/html" in head and b"default-src 'none'" in head, head
        assert b"\r\nserver:" not in head.lower() and b"\r\nx-request-id:" in head.lower()
        assert b"Not found." in body
    time.sleep(0.2)
    assert site.server.log_lines[before:] == []


def test_static_files_answer_as_the_service_with_etags(site: Site) -> None:
    status, data = _raw_get(site, b"/dashboard/static/dashboard.css")
    head = data.partition(b"\r\n\r\n")[0].decode()
    assert status == 200 and "\r\nserver:" not in head.lower()
    assert "\r\nx-request-id:" in head.lower() and "text/css" in head
    etag = re.search(r"(?i)\r\netag: (\"[^\"]+\")", head)
    assert etag, head
    status, data = _raw_get(site, b"/dashboard/static/dashboard.css",
                            b"If-None-Match: " + etag.group(1).encode() + b"\r\n")
    assert status == 304 and data.partition(b"\r\n\r\n")[2] == b""
    body = (Path(__file__).parents[3] / "service/dashboard/static/dashboard.css").read_bytes()
    assert _raw_get(site, b"/dashboard/static/dashboard.css?v=1")[1].endswith(body)


def test_a_forged_cookie_is_never_logged(site: Site) -> None:
    # Tornado logs a version-1 signed value whose signature fails, whole, at
    # WARNING: a Cookie header value in the log, for every request.
    before = len(site.server.log_lines)
    forged = "attacker-chosen-text-" + "q" * 20
    for value in (f"{forged}|1|x", f"{forged}|{int(time.time())}|00", f"2|1:0|10:{forged}|x"):
        resp = Client(site.server, cookies={"logic_session": value}).get("/dashboard")
        assert resp.status == 303
    time.sleep(0.2)
    assert forged not in "".join(site.server.log_lines[before:])


def test_a_non_ascii_xsrf_token_is_refused_like_any_forged_one(site: Site, client: Client) -> None:
    # It was a 500 with an ERROR traceback: compare_digest refuses non-ASCII text.
    client.login(site.link(OWNER))
    before = len(site.server.log_lines)
    for headers in ({"X-XSRF-Token": "\xff"}, {"X-XSRF-Token": "é" * 64}):
        resp = client.request("POST", "/logout", headers=headers)
        assert resp.status == 403, resp.body[:300]
    resp = client.post("/logout", {"_xsrf": "é"})
    assert resp.status == 403
    time.sleep(0.2)
    assert not any(" ERROR " in line for line in site.server.log_lines[before:])
    assert client.get("/dashboard").status == 200     # still signed in: nothing changed
