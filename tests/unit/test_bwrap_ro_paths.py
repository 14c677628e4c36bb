"""Host paths listed read-only (`ro_paths`) in the bubblewrap command line, and the ones refused.

The command line is read as the ordered list bwrap executes: a bind must come after the tmpfs it
lives in, or that tmpfs hides it. The real mounts are tested in
tests/integration/test_sandbox_ro_paths.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentrl.errors import ConfigError
from agentrl.sandboxes.bwrap import bwrap_argv, check_ro_paths, ro_path_problem
from agentrl.sandboxes.local import LocalSandbox


def argv_for(*paths: str, privileged: bool = False) -> list[str]:
    return bwrap_argv("/usr/bin/bwrap", privileged=privileged, extra_ro=paths)


def position(argv: list[str], *op: str) -> int:
    """Where the operation `op` (a flag and its arguments) starts in `argv`."""
    for i in range(len(argv) - len(op) + 1):
        if tuple(argv[i:i + len(op)]) == op:
            return i
    raise AssertionError(f"{' '.join(op)} not in {' '.join(argv)}")


@pytest.mark.parametrize("mount", ["/tmp", "/workspace", "/dev/shm"])
def test_a_path_in_a_private_mount_is_bound_after_the_mount_is_made(mount: str) -> None:
    folder, file = f"{mount}/agentrl-demo", f"{mount}/agentrl-data.json"
    argv = argv_for(folder, file)
    made = position(argv, "--tmpfs", mount)
    assert made < position(argv, "--ro-bind", folder, folder)
    assert made < position(argv, "--ro-bind", file, file)
    assert position(argv, "--ro-bind", file, file) < position(argv, "--remount-ro", "/")
    bound = [argv[i + 2] for i, flag in enumerate(argv) if flag == "--ro-bind"]
    assert mount not in bound and argv.count(mount) == 1 + (mount == "/workspace")  # its tmpfs (and chdir)


def test_parents_of_a_deep_path_sit_on_a_read_only_tmpfs_of_their_own() -> None:
    argv = argv_for("/tmp/agentrl-a/b/data", "/tmp/agentrl-a/c.txt")
    lock = position(argv, "--tmpfs", "/tmp/agentrl-a")
    assert position(argv, "--tmpfs", "/tmp") < lock < position(argv, "--dir", "/tmp/agentrl-a/b")
    assert position(argv, "--dir", "/tmp/agentrl-a/b") < position(
        argv, "--ro-bind", "/tmp/agentrl-a/b/data", "/tmp/agentrl-a/b/data")
    assert argv.count("/tmp/agentrl-a") == 2  # one tmpfs for both paths, and its remount
    remount = position(argv, "--remount-ro", "/tmp/agentrl-a")
    assert position(argv, "--ro-bind", "/tmp/agentrl-a/c.txt", "/tmp/agentrl-a/c.txt") < remount
    assert remount < position(argv, "--remount-ro", "/")
    direct = argv_for("/tmp/agentrl-demo")  # a path directly in /tmp needs no folder of its own
    assert (direct.count("--tmpfs"), direct.count("--remount-ro")) == (3, 1)


def test_paths_outside_the_private_mounts_keep_their_traversable_parents() -> None:
    argv = argv_for("/root/.pyenv/versions/3.11", privileged=True)
    joined = " ".join(argv)
    assert "--perms 0755 --dir /root --perms 0755 --dir /root/.pyenv" in joined
    assert "--tmpfs /root" not in joined
    assert position(argv, "--tmpfs", "/workspace") < position(argv, "--dir", "/root")


def test_a_path_inside_a_listed_one_is_not_bound_twice_whatever_the_order() -> None:
    argv = argv_for("/tmp/agentrl-a/b", "/tmp/agentrl-a")
    assert argv.count("--ro-bind") == argv_for("/tmp/agentrl-a").count("--ro-bind")
    assert "/tmp/agentrl-a/b" not in argv


def test_a_symlink_is_bound_at_its_place_and_at_its_target(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    argv = argv_for(str(link))
    target = str(real.resolve())
    assert position(argv, "--ro-bind", target, str(link)) < position(argv, "--remount-ro", "/")
    assert position(argv, "--ro-bind", target, target) > 0


def test_a_symlink_into_usr_is_bound_at_its_place_only(tmp_path: Path) -> None:
    link = tmp_path / "bin"
    link.symlink_to("/usr/bin")
    argv = argv_for(str(link))
    assert position(argv, "--ro-bind", "/usr/bin", str(link)) > 0
    assert ["--ro-bind", "/usr/bin", "/usr/bin"] not in [argv[i:i + 3] for i in range(len(argv))]


@pytest.mark.parametrize(("path", "reason"), [
    ("/", "is the root"),
    ("/tmp", "is the sandbox's private /tmp"),
    ("/dev/shm", "is the sandbox's private /dev/shm"),
    ("/proc", "is /proc, which the sandbox makes anew"),
    ("/proc/self", "is under /proc"),
    ("/dev", "is /dev, which the sandbox makes anew"),
    ("/dev/null", "is under /dev"),
    ("/root", "is the host's home folder /root"),
])
def test_paths_that_would_undo_the_isolation_are_refused(path: str, reason: str) -> None:
    problem = ro_path_problem(path)
    assert problem is not None and problem.startswith(f"{path!r} {reason}")
    with pytest.raises(ConfigError, match="Cannot show"):
        argv_for(path)  # the command line refuses them too, whoever calls it


def test_a_folder_holding_a_private_mount_or_the_home_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "users" / "me"
    home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    assert ro_path_problem(str(home)) == f"{str(home)!r} is the host's home folder {home}: " \
                                         "list the files or folders under it that are needed"
    assert "holds the host's home folder" in (ro_path_problem(str(tmp_path / "users")) or "")
    (home / "project").mkdir()
    assert ro_path_problem(str(home / "project")) is None  # what is inside the home is fine


def test_a_symlink_into_a_hidden_place_is_refused_with_its_target(tmp_path: Path) -> None:
    link = tmp_path / "looks-harmless"
    link.symlink_to("/proc")
    assert ro_path_problem(str(link)) == (f"{str(link)!r} leads through symlinks to '/proc', which is /proc, "
                                          "which the sandbox makes anew and never shows the host's")
    root_link = tmp_path / "everything"
    root_link.symlink_to("/")
    assert "leads through symlinks to '/', which is the root" in (ro_path_problem(str(root_link)) or "")


def test_missing_paths_are_refused_and_relative_ones_say_where_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert ro_path_problem(str(tmp_path / "gone")) == (
        f"{str(tmp_path / 'gone')!r} does not exist on this machine: give an existing file or folder")
    assert ro_path_problem("gone") == (
        f"'gone' does not exist on this machine (relative to {os.getcwd()}): give an existing file or folder")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    assert "does not exist" in (ro_path_problem("dangling") or "")
    (tmp_path / "here").mkdir()
    assert ro_path_problem("here") is None and ro_path_problem(".") is None
    assert ro_path_problem("") == "is empty: give a host path"


def test_every_refused_path_is_named_by_its_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        check_ro_paths([str(tmp_path), "/tmp", str(tmp_path / "gone")], "ro_paths")
    assert [line.split(":")[0] for line in caught.value.errors] == ["ro_paths[1]", "ro_paths[2]"]
    assert str(caught.value).splitlines() == caught.value.errors
    check_ro_paths([str(tmp_path)], "ro_paths")  # nothing to say


def test_the_local_sandbox_refuses_its_ro_paths_before_starting_anything(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^ro_paths\[1\]: '/tmp' is the sandbox's private /tmp"):
        LocalSandbox(isolation="none", ro_paths=[str(tmp_path), "/tmp"])
    with pytest.raises(ConfigError, match=r"ro_paths: give a list of paths"):
        LocalSandbox(isolation="none", ro_paths=str(tmp_path))  # type: ignore[arg-type]
