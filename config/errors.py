"""The one exception type for configuration a user got wrong (bad path, unsupported model)."""


class ConfigError(ValueError):
    """A configuration problem worth one clear line to the user, not a traceback."""
