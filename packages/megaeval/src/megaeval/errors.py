"""Errors the evaluations raise for bad input, before (or instead of) running a model."""


class EvalDataError(ValueError):
    """An evaluation data file that cannot be used; the message names the file (and line)."""


class EvalSettingsError(ValueError):
    """Evaluation settings that do not fit the data or the model; the message names the flag."""
