"""The exception tree: one root, drawn in the module docstring."""

from __future__ import annotations

import inspect

import agentrl.errors as errors


def test_every_error_derives_from_the_root_and_is_drawn_in_the_docstring() -> None:
    classes = [obj for _, obj in inspect.getmembers(errors, inspect.isclass) if obj.__module__ == errors.__name__]
    assert len(classes) == len(errors.__all__)
    for cls in classes:
        assert issubclass(cls, errors.AgentRLError)
        assert cls.__name__ in errors.__doc__, f"{cls.__name__} is missing from the tree drawing"
        assert cls.__doc__


def test_errors_keep_the_builtin_types_callers_already_catch() -> None:
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.UnknownNameError, LookupError)
    assert issubclass(errors.FeatureUnavailableError, NotImplementedError)
    assert errors.ToolArgumentError("x").fault == "model"
    assert errors.ToolInfrastructureError("x").fault == "infra"
    e = errors.ConfigError("two problems", ["a", "b"])
    assert e.errors == ["a", "b"]
