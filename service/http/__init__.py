"""The HTTP front: connection layer, invoke endpoint (the hot path), Tornado app, errors, health, server start/stop."""
