"""The one error every refusal of a config raises, and the check that raises it."""


class ConfigError(ValueError):
    """A config file or override that cannot run; the message names the field and what is wrong."""


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
