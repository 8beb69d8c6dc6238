from click.testing import CliRunner

from megatrain.cli import main


def test_help_and_unknown_command():
    result = CliRunner().invoke(main, ["-h"])
    assert result.exit_code == 0 and "pipeline and data parallelism" in result.output
    assert CliRunner().invoke(main, ["no-such-command"]).exit_code == 2
