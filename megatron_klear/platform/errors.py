"""Errors every layer may raise."""


class ConfigError(ValueError):
    """A job-config value that cannot work; the message names the key (and, from YAML, file:line)."""
