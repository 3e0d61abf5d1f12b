"""Peewee models, migrations and the database handle (no Tornado, no sandbox)."""
from models.audit import AuditRecord
from models.db import BaseModel, connect, database
from models.guild import Guild, GuildManager
from models.installation import Installation
from models.interaction import SeenInteraction
from models.journal_mark import JournalMark
from models.record import ErrorRecord, RequestRecord
from models.script import Endpoint, Script, ScriptVersion
from models.session import DashboardSession
from models.stats import StatBucket, StatIp, StatSketch
from models.token import ApiToken, LoginToken

#: Every table, in creation order (parents first).
ALL_MODELS = (Guild, GuildManager, Script, Endpoint, RequestRecord, ErrorRecord,
              AuditRecord, StatBucket, StatIp, ApiToken, LoginToken, DashboardSession,
              ScriptVersion, StatSketch, SeenInteraction, JournalMark, Installation)

__all__ = ["ALL_MODELS", "ApiToken", "AuditRecord", "BaseModel", "DashboardSession", "Endpoint",
           "ErrorRecord", "Guild", "GuildManager", "Installation", "JournalMark", "LoginToken", "RequestRecord", "Script",
           "ScriptVersion", "SeenInteraction", "StatBucket", "StatIp", "StatSketch", "connect", "database"]
