"""The chat command `/logic` over the platform's HTTP interactions protocol.

`signature` (is it the platform, fresh, once), `protocol` (the protocol's
numbers, parsing, reply shapes), `commands` (the command table: dispatch and
registration JSON), `subcommands` (one function per subcommand over
`service.core`), `followup` (the one outbound call, for deferred replies)
and `handler` (the Tornado handler and its route).  See docs/chat-command.md.
"""
