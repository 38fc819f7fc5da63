"""The ``rlharvest`` command: ``--version``, quick help, and the node command's arguments, messages and
exit statuses (docs/elastic.md, "The node command"). Nodes that join and collect:
tests/collectors/distributed/test_node_command.py."""

from __future__ import annotations

import importlib.metadata
import os
import secrets
import subprocess
import sys

import pytest

import rlharvest
from rlharvest._node_cli import EXIT_CODES
from rlharvest.transport.ports import free_port

pytestmark = pytest.mark.timeout(120)


def run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlharvest", *argv], capture_output=True, text=True, timeout=100,
                          env=env)


def test_the_version_is_the_installed_package_s():
    assert rlharvest.__version__ == importlib.metadata.version("rlharvest")
    done = run("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"rlharvest {rlharvest.__version__}"


def test_parsing_a_command_line_imports_no_torch():
    code = ("import sys\nfrom rlharvest.cli import build_parser\n"
            "build_parser().parse_args(['node', '--join', 'h:1', '--key-file', 'k'])\n"
            "heavy = sorted(m for m in ('torch', 'tensordict', 'numpy') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr


def test_help_lists_the_commands_and_the_node_s_exit_statuses():
    done = run("--help")
    assert done.returncode == 0 and all(command in done.stdout for command in ("demo", "bench", "node"))
    node = run("node", "--help")
    assert node.returncode == 0 and "--join" in node.stdout and "--rank" in node.stdout
    assert all(f"{code} " in " ".join(node.stdout.split()) for code in EXIT_CODES)


@pytest.mark.parametrize("argv, says", [
    (["--join", "nowhere", "--key-file", "k"], "--join must be HOST:PORT"),
    (["--join", "h:1"], "--join needs --key-file"),
    (["--join", "h:1", "--key-file", "k", "--rank", "1"], "--join and --rank are two ways"),
    (["--rank", "1", "--world-size", "2"], "--host, --port missing"),
    (["--rank", "2", "--world-size", "2", "--host", "h", "--port", "1"], "--rank must be in 1..1"),
    (["--join", "h:1", "--key-file", "k", "--timeout", "0"], "--timeout must be a positive number of seconds"),
    ([], "say which collector to serve"),
])
def test_a_bad_argument_is_one_line_and_status_2(argv, says):
    done = run("node", *argv)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("rlharvest node: error: "), done.stderr
    assert says in lines[0], lines


def test_a_key_file_others_may_read_or_that_is_missing_is_status_2(tmp_path):
    key = tmp_path / "key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o644)
    for path in (key, tmp_path / "missing"):
        done = run("node", "--join", f"127.0.0.1:{free_port()}", "--key-file", str(path))
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert str(path) in done.stderr


def test_an_unreachable_collector_is_retried_then_one_line_and_status_4(tmp_path):
    key = tmp_path / "key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    done = run("node", "--join", address, "--key-file", str(key), "--timeout", "2")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 4, done.stderr
    # one line per change of its state, then the failure in one line
    assert lines == [f"rlharvest node: connecting to {address}",
                     f"rlharvest node: nothing answers at {address} yet (Connection refused): retrying for up to 2 s",
                     f"rlharvest node: no collector answered at {address} within 2 s (Connection refused)."], lines


def test_the_former_spellings_still_work_and_say_they_are_deprecated(tmp_path):
    key = tmp_path / "key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    port = free_port()
    done = run("node", "--join", f"127.0.0.1:{port}", "--authkey-file", str(key), "--timeout", "0.5")
    assert done.returncode == 4 and "--authkey-file is deprecated: use --key-file" in done.stderr, done.stderr
    module = subprocess.run([sys.executable, "-m", "rlharvest.collectors.distributed.node", "--help"],
                            capture_output=True, text=True, timeout=100, env={**os.environ})
    assert module.returncode == 0 and "--rank" in module.stdout
