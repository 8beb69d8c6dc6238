"""How every command fails: one line on stderr, `PROGRAM COMMAND: message`, and an exit
status that says whose fault it was: 2 for a usage or input error (a flag, config, recipe,
file or address that is not what was expected; fix it and run again), 1 for a failure while
working (something broke; the message says what, and a rerun resumes)."""

import sys
from pathlib import Path

import click

USAGE_OR_INPUT, FAILURE = 2, 1


class CommandError(click.ClickException):
    """Raise inside a click command: click prints `show()` and exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int = USAGE_OR_INPUT, where: str | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        ctx = click.get_current_context(silent=True)
        self.where = where or (ctx.command_path if ctx else Path(sys.argv[0]).name)

    def show(self, file=None) -> None:
        click.echo(f"{self.where}: {self.format_message()}", err=True)
