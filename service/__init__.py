"""The Tornado service: HTTP handlers, service layer, CLI."""
