"""The one error type every layer may raise for a bad input."""


class UsageError(ValueError):
    """A bad flag or config value, found before any expensive work (CLIs: one `error:` line, status 2)."""
