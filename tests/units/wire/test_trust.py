"""peerd init / invite / join: identity, secret, file modes, tokens, state-dir resolution."""

import contextlib
import json
import os
import stat
import subprocess
import time

import pytest

from peerd import statedir
from peerd.commands.cli import main
from peerd.errors import PeerdError
from peerd.wire import identity, join_token


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _invite(state_dir, capsys) -> str:
    capsys.readouterr()
    assert main(["invite", "--state-dir", str(state_dir)]) == 0
    return capsys.readouterr().out.strip()


def test_init_creates_identity_and_secret_readable_only_by_the_owner(tmp_path, capsys):
    state = tmp_path / "a"
    assert main(["init", "--state-dir", str(state), "--name", "desk"]) == 0
    me = identity.load_identity(state)
    assert me.name == "desk"
    assert me.id == identity.peer_id_for(me.keys.public)
    assert len(identity.load_secret(state).secret) == identity.SECRET_BYTES
    assert _mode(state) == 0o700
    for name in (identity.IDENTITY_FILE, identity.CLUSTER_FILE):
        assert _mode(state / name) == 0o600
    assert me.id in capsys.readouterr().out


def test_invite_then_join_shares_the_secret_but_not_the_identity(tmp_path, capsys):
    first, second = tmp_path / "a", tmp_path / "b"
    main(["init", "--state-dir", str(first)])
    token = _invite(first, capsys)
    assert main(["join", token, "--state-dir", str(second), "--name", "laptop"]) == 0
    assert identity.load_secret(first) == identity.load_secret(second)
    assert identity.load_identity(first).id != identity.load_identity(second).id
    assert _mode(second / identity.CLUSTER_FILE) == 0o600


def test_identity_is_stable_across_restarts_and_renames(tmp_path):
    main(["init", "--state-dir", str(tmp_path), "--name", "one"])
    before = identity.load_identity(tmp_path)
    after = identity.ensure_identity(tmp_path, "two")
    assert (after.id, after.keys) == (before.id, before.keys)
    assert identity.load_identity(tmp_path).name == "two"


def test_init_refuses_a_state_dir_that_already_has_a_cluster(tmp_path, capsys):
    main(["init", "--state-dir", str(tmp_path)])
    assert main(["init", "--state-dir", str(tmp_path)]) == 1
    assert "already belongs to cluster" in capsys.readouterr().err


def test_join_refuses_another_cluster_but_accepts_its_own_token_again(tmp_path, capsys):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    main(["init", "--state-dir", str(ours)])
    main(["init", "--state-dir", str(theirs)])
    own_token, foreign_token = _invite(ours, capsys), _invite(theirs, capsys)
    assert main(["join", own_token, "--state-dir", str(ours)]) == 0
    assert main(["join", foreign_token, "--state-dir", str(ours)]) == 1
    assert "already belongs to cluster" in capsys.readouterr().err


def test_invite_without_a_cluster_explains_what_to_do(tmp_path, capsys):
    assert main(["invite", "--state-dir", str(tmp_path)]) == 1
    assert "peerd init" in capsys.readouterr().err


def test_token_round_trip_and_format():
    secret = identity.ClusterSecret(bytes(range(32)))
    token = join_token.encode(secret)
    assert token.startswith("peerd1-") and "=" not in token
    assert join_token.decode(token) == secret
    assert join_token.decode(f"  {token}\n") == secret


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda t: "hello", "not a peerd join token"),
        (lambda t: t[:-3], "wrong length|not base64url"),
        (lambda t: t[:-1] + ("A" if t[-1] != "A" else "B"), "checksum"),
        (lambda t: t[:10] + ("x" if t[10] != "x" else "y") + t[11:], "checksum"),
        (lambda t: t + "!!", "not base64url|wrong length"),
    ],
)
def test_damaged_tokens_are_refused_with_a_reason(damage, reason):
    token = join_token.encode(identity.ClusterSecret(b"\x01" * 32))
    with pytest.raises(PeerdError, match=reason):
        join_token.decode(damage(token))


def test_damaged_identity_file_is_reported(tmp_path):
    main(["init", "--state-dir", str(tmp_path)])
    path = tmp_path / identity.IDENTITY_FILE
    content = json.loads(path.read_text())
    content["id"] = "0" * 16
    path.write_text(json.dumps(content))
    with pytest.raises(PeerdError, match="id does not match"):
        identity.load_identity(tmp_path)


def test_hello_keys_are_derived_from_the_secret_alone():
    one, same, other = (identity.ClusterSecret(s) for s in (b"a" * 32, b"a" * 32, b"b" * 32))
    assert one.hello_server_keys() == same.hello_server_keys()
    assert one.hello_server_keys() != other.hello_server_keys()
    assert one.hello_client_keys() != one.hello_server_keys()


class TestStateDirResolution:
    @pytest.fixture(autouse=True)
    def clean_environment(self, monkeypatch, tmp_path):
        for name in ("PEERD_STATE_DIR", "STATE_DIRECTORY", "XDG_STATE_HOME"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HOME", str(tmp_path / "home"))

    def test_explicit_flag_wins(self, monkeypatch):
        monkeypatch.setenv("PEERD_STATE_DIR", "/env")
        assert str(statedir.resolve("/flag")) == "/flag"

    def test_peerd_state_dir_then_systemd_state_directory(self, monkeypatch):
        monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/peerd:/var/lib/other")
        assert str(statedir.resolve(None)) == "/var/lib/peerd"
        monkeypatch.setenv("PEERD_STATE_DIR", "/env")
        assert str(statedir.resolve(None)) == "/env"

    def test_xdg_state_home_then_home(self, monkeypatch, tmp_path):
        assert statedir.resolve(None) == tmp_path / "home" / ".local" / "state" / "peerd"
        monkeypatch.setenv("XDG_STATE_HOME", "/xdg")
        assert str(statedir.resolve(None)) == "/xdg/peerd"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tiny tmpfs needs root")
def test_a_full_state_directory_fails_at_once_naming_it_and_leaves_no_half_file(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], check=True)
    try:
        target = full / "identity.json"
        statedir.write_secret_json(target, {"kept": True})
        with contextlib.suppress(OSError), (full / "filler").open("wb") as filler:
            filler.write(bytes(1 << 20))
        started = time.monotonic()
        with pytest.raises(PeerdError, match=f"no space left in {full} "):
            statedir.write_secret_json(target, {"big": "x" * 100_000})
        assert time.monotonic() - started < 1.0
        assert statedir.read_json(target) == {"kept": True}
        assert sorted(p.name for p in full.iterdir()) == ["filler", "identity.json"]
    finally:
        subprocess.run(["umount", str(full)], check=True)
