from click.testing import CliRunner

from megaeval.cli import main


def test_help_names_the_papers_evaluations():
    output = CliRunner().invoke(main, ["--help"]).output
    assert all(task in output for task in ("WikiText103", "LAMBADA", "fine-tuning"))
