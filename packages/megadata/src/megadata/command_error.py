"""How megadata's commands fail: one line on stderr, `megadata COMMAND: message`, exit status 2
for a usage or input error (a recipe, flag, file or address that is not what was expected) and
1 for a failure while working: the convention megatrain and megaeval follow too."""

import click

USAGE_OR_INPUT, FAILURE = 2, 1


class CommandError(click.ClickException):
    def __init__(self, message: str, exit_code: int = USAGE_OR_INPUT):
        super().__init__(message)
        self.exit_code = exit_code
        ctx = click.get_current_context(silent=True)
        self.where = ctx.command_path if ctx else "megadata"

    def show(self, file=None) -> None:
        click.echo(f"{self.where}: {self.format_message()}", err=True)
