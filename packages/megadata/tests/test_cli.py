from click.testing import CliRunner

from megadata.cli import main


def test_help_and_unknown_stage():
    runner = CliRunner()
    assert "deduplicated and tokenized" in runner.invoke(main, ["-h"]).output
    result = runner.invoke(main, ["no-such-stage"])
    assert result.exit_code == 2 and "No such command 'no-such-stage'" in result.output
