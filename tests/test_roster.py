import os
import stat

import pytest

from protocol.roster import MPC_CERTIFICATES, Credentials, Roster, RosterError, provision


def test_provision_writes_private_keys_and_a_public_roster(tmp_path):
    previous = os.umask(0)  # files must not follow a permissive umask
    try:
        roster = provision(tmp_path / "fed", hospitals=3, address="tcp://127.0.0.1:6000")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "fed" / "roster.toml").stat().st_mode) == 0o600
    assert roster.hospitals == ["hospital-1", "hospital-2", "hospital-3"]
    assert roster.server_address == "tcp://127.0.0.1:6000"
    secret_file = tmp_path / "fed" / "hospital-2" / "secret_keys.toml"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    credentials = Credentials.load(tmp_path / "fed", "hospital-2")
    assert credentials.curve.public == roster.party("hospital-2").curve_public
    assert credentials.identity.public.to_text() == roster.party("hospital-2").identity.to_text()
    public_text = (tmp_path / "fed" / "roster.toml").read_text()
    assert "secret" not in public_text and credentials.curve.secret.decode() not in public_text


def test_provision_refuses_to_overwrite_or_bad_input(tmp_path):
    provision(tmp_path, hospitals=1, address="tcp://127.0.0.1:6000")
    with pytest.raises(RosterError, match="already holds a federation"):
        provision(tmp_path, hospitals=1, address="tcp://127.0.0.1:6000")
    with pytest.raises(RosterError, match="tcp://HOST:PORT"):
        provision(tmp_path / "other", hospitals=1, address="localhost")
    with pytest.raises(RosterError, match="at least one hospital"):
        provision(tmp_path / "other", hospitals=0, address="tcp://127.0.0.1:6000")


def test_missing_or_malformed_files_are_named(tmp_path):
    with pytest.raises(RosterError, match="run consilium-provision first"):
        Roster.load(tmp_path)
    provision(tmp_path, hospitals=1, address="tcp://127.0.0.1:6000")
    with pytest.raises(RosterError, match="is 'hospital-9' a party"):
        Credentials.load(tmp_path, "hospital-9")
    with pytest.raises(RosterError, match="not in the roster"):
        Roster.load(tmp_path).party("hospital-9")
    roster_file = tmp_path / "roster.toml"
    roster_file.write_text(roster_file.read_text().replace("curve_public = '", "curve_public = 'x", 1))
    with pytest.raises(RosterError, match="40 z85 characters"):
        Roster.load(tmp_path)
    roster_file.write_text("[server\n")
    with pytest.raises(RosterError, match="cannot read"):
        Roster.load(tmp_path)


def test_keys_from_another_provisioning_are_refused(tmp_path):
    roster = provision(tmp_path / "a", hospitals=1, address="tcp://127.0.0.1:6000")
    provision(tmp_path / "b", hospitals=1, address="tcp://127.0.0.1:6000")
    roster.check_credentials(Credentials.load(tmp_path / "a", "hospital-1"))
    with pytest.raises(RosterError, match="do not match its entry"):
        roster.check_credentials(Credentials.load(tmp_path / "b", "hospital-1"))


def test_talliers_get_an_mpc_address_and_private_certificates(tmp_path):
    addresses = ("127.0.0.1:7001", "127.0.0.1:7002", "10.0.0.3:7003")
    roster = provision(tmp_path / "fed", hospitals=2, address="tcp://127.0.0.1:7000", mpc_addresses=addresses)
    assert roster.talliers == ["tallier-1", "tallier-2", "tallier-3"]
    assert roster.hospitals == ["hospital-1", "hospital-2"]
    assert Roster.load(tmp_path / "fed").party("tallier-3").mpc_address == ("10.0.0.3", 7003)
    certificates = tmp_path / "fed" / "tallier-2" / MPC_CERTIFICATES
    assert sorted(p.name for p in certificates.iterdir()) == ["mpyc_ca.crt", "party_1.crt", "party_1.key"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in certificates.iterdir())
    assert "PRIVATE KEY" not in (tmp_path / "fed" / "roster.toml").read_text()


@pytest.mark.parametrize(
    "addresses, message",
    [
        (("127.0.0.1:7001", "127.0.0.1:7002"), "at least 3 talliers"),
        (("127.0.0.1:7001", "127.0.0.1:7001", "127.0.0.1:7003"), "its own MPC address"),
        (("127.0.0.1:7001", "tcp://127.0.0.1:7002", "127.0.0.1:7003"), "HOST:PORT"),
        (("127.0.0.1:7001", "127.0.0.1:70000", "127.0.0.1:7003"), "HOST:PORT"),
    ],
)
def test_bad_tallier_addresses_are_refused(tmp_path, addresses, message):
    with pytest.raises(RosterError, match=message):
        provision(tmp_path / "fed", hospitals=1, address="tcp://127.0.0.1:7000", mpc_addresses=addresses)
    assert not (tmp_path / "fed").exists()
