"""Registries: lazy built-ins, import paths, user registration, suggestions for unknown names."""

from __future__ import annotations

import pytest

from agentrl.errors import UnknownNameError
from agentrl.registry import ENVS, REGISTRIES, Registry, import_object


@pytest.mark.parametrize("kind", sorted(REGISTRIES))
def test_every_builtin_entry_resolves(kind: str) -> None:
    registry = REGISTRIES[kind]
    for name in registry.names():
        assert registry.resolve(name) is not None, f"{kind} '{name}' does not import"


def test_unknown_name_suggests_closest_and_the_list_command() -> None:
    with pytest.raises(UnknownNameError) as info:
        ENVS.resolve("arithmatic")
    assert info.value.suggestions == ["arithmetic"]
    assert "Did you mean 'arithmetic'?" in str(info.value)
    assert "agentrl envs list" in str(info.value)


def test_import_path_works_wherever_a_name_does() -> None:
    from agentrl.envs.arithmetic import ArithmeticEnv

    assert ENVS.resolve("agentrl.envs.arithmetic:ArithmeticEnv") is ArithmeticEnv
    with pytest.raises(UnknownNameError, match="Cannot import module 'no_such_pkg.mod'"):
        import_object("no_such_pkg.mod:X")
    with pytest.raises(UnknownNameError, match="has no attribute 'Nope'"):
        import_object("agentrl.envs.arithmetic:Nope")
    with pytest.raises(UnknownNameError, match="package.module:Object"):
        import_object("agentrl.envs.arithmetic")


def test_register_decorator_and_duplicate_names() -> None:
    reg = Registry("widget", "agentrl widgets list", {"lazy": ("agentrl.types:Action", "an action")})

    @reg.register("mine")
    class MyWidget:
        """A widget of mine."""

    assert reg.resolve("mine") is MyWidget
    assert reg.entries()[1].description == "A widget of mine."
    assert reg.names() == ["lazy", "mine"]
    with pytest.raises(ValueError, match="already registered"):
        reg.add("mine", object())
    reg.add("mine", int, overwrite=True)
    assert reg.resolve("mine") is int
