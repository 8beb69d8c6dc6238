"""The one error every refusal of a config raises."""


class ConfigError(ValueError):
    """A config file or override that cannot run; the message names the field and what is wrong."""
