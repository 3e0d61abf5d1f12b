"""The Dashboard: server-rendered pages for guild owners and managers.

Tornado templates (`templates/`), one stylesheet and one script
(`static/`, shipped in the package; no build step, nothing from a CDN, no
inline script).  Every rule is the service layer's (`service.core`); the
handlers translate forms into its calls.  Routes (the contract's): `GET
/login/{token}`, `POST /logout`, `GET /dashboard` (guild list),
`/dashboard/G` (overview), `/dashboard/G/scripts/S` (the script and its
Endpoints tab), plus the forms each page posts to.
"""
from __future__ import annotations

from typing import Any

from service.dashboard import auth, console, guilds, scripts
from service.dashboard.base import Dashboard, DashboardNotFoundHandler, DashboardStaticHandler

G = r"([0-9]{1,25})"
S = r"(logic_[A-Za-z0-9_-]{22})"


def routes(context: Any) -> list[tuple[str, Any, dict[str, Any]]]:
    """The dashboard's routes, each handler given `context` and the shared `Dashboard`."""
    dashboard = Dashboard(context.settings)
    args = {"context": context, "dashboard": dashboard}
    table: list[tuple[str, Any]] = [
        (r"/dashboard/static/(.*)", DashboardStaticHandler),
        (r"/login", auth.LoginHelpHandler),
        (r"/login/([A-Za-z0-9_-]{1,100})", auth.LoginHandler),
        (r"/logout", auth.LogoutHandler),
        (r"/dashboard/?", guilds.GuildListHandler),
        (rf"/dashboard/{G}", guilds.GuildHandler),
        (rf"/dashboard/{G}/managers", guilds.ManagersHandler),
        (rf"/dashboard/{G}/scripts/{S}", scripts.ScriptHandler),
        (rf"/dashboard/{G}/scripts/{S}/source", scripts.SourceHandler),
        (rf"/dashboard/{G}/scripts/{S}/endpoint", scripts.SwitchHandler),
        (rf"/dashboard/{G}/scripts/{S}/whitelist", scripts.WhitelistHandler),
        (rf"/dashboard/{G}/scripts/{S}/secret", scripts.SecretHandler),
        (rf"/dashboard/{G}/scripts/{S}/test", console.ConsoleHandler),
        (rf"/dashboard/{G}/scripts/{S}/replay", console.ReplayHandler),
        # Last: what the routes above do not match still answers as the dashboard.
        (r"/login/.*", auth.MalformedLinkHandler),
        (r"/dashboard/.*", DashboardNotFoundHandler),
    ]
    return [(pattern, handler, args) for pattern, handler in table]


__all__ = ["routes"]
