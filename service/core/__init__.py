"""The service layer: every rule (roles, plans, quotas, secrets, records, reads), with no Tornado.

The CLI, the admin API and the dashboard call these functions with an
`Actor`; they raise `service.core.errors.CoreError` subclasses, which each
front maps (HTTP status / exit code).  The database must be connected
(`models.db.connect`) before any call.
"""
from service.core.access import Actor, Role
from service.core.audit import audit_log
from service.core.endpoints import (disable_endpoint, enable_endpoint, endpoint_url,
                                    set_whitelist, show_endpoint)
from service.core.errors import (ConflictError, CoreError, NotFoundError,
                                 PermissionDeniedError, QuotaError, ValidationError)
from service.core.guilds import (add_manager, create_guild, list_guilds, remove_manager, set_plan,
                                 show_guild)
# The error-log read is exported as `error_log`: as `errors` it would shadow the
# `service.core.errors` module of error classes.
from service.core.reads import errors as error_log
from service.core.reads import history, stats
from service.core.scripts import (create_script, delete_script, list_scripts, show_script,
                                  update_script)
from service.core.record_queries import error_page, history_page, history_record
from service.core.script_checks import check_source
from service.core.secrets import regenerate_secret, verify_secret
from service.core.tokens import (authenticate_token, consume_login_token, create_api_token,
                                 create_login_link, revoke_api_token)
from service.core.versions import list_versions, rollback

__all__ = [
    "Actor", "Role", "audit_log", "disable_endpoint", "enable_endpoint", "endpoint_url",
    "set_whitelist", "show_endpoint", "ConflictError", "CoreError", "NotFoundError",
    "PermissionDeniedError", "QuotaError", "ValidationError", "add_manager", "create_guild", "list_guilds",
    "remove_manager", "set_plan", "show_guild", "error_log", "history", "stats", "create_script",
    "delete_script", "list_scripts", "show_script", "update_script", "regenerate_secret",
    "verify_secret", "authenticate_token", "consume_login_token", "create_api_token",
    "create_login_link", "revoke_api_token",
    "check_source", "list_versions", "rollback", "error_page", "history_page", "history_record",
]
