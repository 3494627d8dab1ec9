"""Keys born where they are used, a roster assembled from public files, and every party's checks of it."""

import base64
import os
import pathlib
import re
import shutil
import stat

import pytest

from consilium.protocol.identity.key_files import KeyFileError
from consilium.protocol.identity.party_keys import MPC_KEY_FILE, SECRET_FILE, Credentials, generate_party_keys
from consilium.protocol.identity.roster import ROSTER_FILE, Roster, RosterError, assemble_roster, local_federation
from consilium.protocol.identity.roster_confirmation import (
    ACCEPTED_ROSTER_FILE,
    SIGNATURES_FILE,
    confirm_roster,
    join_federation,
    sign_roster,
)
from conftest import run_launcher

ADDRESS = "tcp://127.0.0.1:6000"


def _party_folders(root, hospitals=2, talliers=0):
    """Each party's keys made in a folder of its own, as on its own machine; their public files."""
    parties = [("server", "server", None)] + [(f"hospital-{i}", "hospital", None) for i in range(1, hospitals + 1)]
    parties += [(f"tallier-{i}", "tallier", f"10.0.0.{i}:700{i}") for i in range(1, talliers + 1)]
    return [
        generate_party_keys(root / "machines" / name, name=name, role=role, mpc_address_text=a)
        for name, role, a in parties
    ]


def _install(root, roster_dir, name):
    """A party's federation directory on its machine: its own folder and the roster it received."""
    federation = root / f"at-{name}"
    shutil.copytree(root / "machines" / name, federation / name)
    shutil.copy(roster_dir / ROSTER_FILE, federation / ROSTER_FILE)
    if (roster_dir / SIGNATURES_FILE).exists():
        shutil.copy(roster_dir / SIGNATURES_FILE, federation / SIGNATURES_FILE)
    return federation


def test_keygen_keeps_secrets_in_the_party_s_folder_and_provisioning_reads_only_public_files(tmp_path):
    previous = os.umask(0)  # files must not follow a permissive umask
    try:
        public_files = _party_folders(tmp_path, talliers=3)
    finally:
        os.umask(previous)
    hospital = tmp_path / "machines" / "hospital-2"
    assert stat.S_IMODE((hospital / SECRET_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "machines" / "tallier-1" / MPC_KEY_FILE).stat().st_mode) == 0o600
    credentials = Credentials.load(hospital)
    # The provisioner holds nothing but the public files: no secret, and nothing it could pass off as one.
    handed_over = tmp_path / "provisioner"
    handed_over.mkdir()
    for path in public_files:
        shutil.copy(path, handed_over / path.name)
        text = path.read_text()
        assert "secret" not in text and "PRIVATE" not in text and credentials.curve.secret.decode() not in text
    roster = assemble_roster(tmp_path / "fed", address=ADDRESS, public_files=sorted(handed_over.iterdir()))
    assert sorted(p.name for p in (tmp_path / "fed").iterdir()) == [ROSTER_FILE]
    assert stat.S_IMODE((tmp_path / "fed" / ROSTER_FILE).stat().st_mode) == 0o600
    assert roster.hospitals == ["hospital-1", "hospital-2"] and roster.talliers == [
        "tallier-1",
        "tallier-2",
        "tallier-3",
    ]
    assert roster.party("tallier-3").mpc_address == ("10.0.0.3", 7003)
    assert roster.party("hospital-2").curve_public == credentials.curve.public
    assert re.fullmatch(r"(\d{5} ){11}\d{5}", roster.fingerprint)
    roster.check_own_entry(credentials)
    roster.check_own_entry(Credentials.load(tmp_path / "machines" / "tallier-2"))  # its pinned certificate is its own


def test_a_provisioner_who_swaps_a_hospital_s_keys_for_its_own_is_refused(tmp_path):
    """The insider attack: the provisioner lists keys it made as hospital-2's, to be sealed the run's BFV key.
    hospital-2 will not vouch for that roster, and a hospital started with the fingerprint the
    consortium compared refuses it, so no key is ever sealed to the impostor."""
    public_files = _party_folders(tmp_path)
    honest = assemble_roster(tmp_path / "honest", address=ADDRESS, public_files=public_files)
    impostor = generate_party_keys(tmp_path / "impostor", name="hospital-2", role="hospital")
    swapped = [impostor if path.name == "hospital-2.public.toml" else path for path in public_files]
    forged = assemble_roster(tmp_path / "forged", address=ADDRESS, public_files=swapped)
    assert forged.fingerprint != honest.fingerprint

    at_hospital_2 = _install(tmp_path, tmp_path / "forged", "hospital-2")
    checked = run_launcher("roster", "fingerprint", "--federation", at_hospital_2, "--name", "hospital-2")
    assert checked.returncode == 2 and "the roster's entry for hospital-2 is not this party's keys" in checked.stderr
    assert "Traceback" not in checked.stderr
    with pytest.raises(RosterError, match="not this party's keys"):
        join_federation(at_hospital_2, "hospital-2", forged.fingerprint)

    at_hospital_1 = _install(tmp_path, tmp_path / "forged", "hospital-1")
    with pytest.raises(RosterError, match="fingerprint is .*, not the .* given"):
        join_federation(at_hospital_1, "hospital-1", honest.fingerprint)
    assert not (at_hospital_1 / "hospital-1" / ACCEPTED_ROSTER_FILE).exists()


def test_a_roster_is_confirmed_by_its_fingerprint_once_then_kept(tmp_path):
    public_files = _party_folders(tmp_path)
    roster = assemble_roster(tmp_path / "fed", address=ADDRESS, public_files=public_files)
    federation = _install(tmp_path, tmp_path / "fed", "hospital-1")
    with pytest.raises(RosterError, match="not confirmed"):
        join_federation(federation, "hospital-1", None)
    spoken = roster.fingerprint.replace(" ", "-")  # as read aloud and typed: separators do not matter
    assert join_federation(federation, "hospital-1", spoken)[0].digest == roster.digest
    assert join_federation(federation, "hospital-1", None)[0].digest == roster.digest  # a restart needs nothing new
    roster_file = federation / ROSTER_FILE
    roster_file.write_text(roster_file.read_text().replace(ADDRESS, "tcp://127.0.0.1:6001"))  # one byte changed
    with pytest.raises(RosterError, match="not confirmed"):
        join_federation(federation, "hospital-1", None)


def test_a_new_roster_version_is_confirmed_by_the_signatures_of_every_party_that_stays(tmp_path):
    """hospital-3 leaves: the new version names the old one's digest and carries the signature of
    every party that stays; a party that confirmed the old one accepts it without a new fingerprint.
    Signatures never vouch for keys: a version that adds a party needs the fingerprint again."""
    public_files = _party_folders(tmp_path, hospitals=3)
    first = assemble_roster(tmp_path / "v1", address=ADDRESS, public_files=public_files)
    for name in ("server", "hospital-1", "hospital-2", "hospital-3"):  # each on its own machine
        confirm_roster(tmp_path / "v1", Credentials.load(tmp_path / "machines" / name), first.fingerprint)
    federation = _install(tmp_path, tmp_path / "v1", "hospital-1")
    join_federation(federation, "hospital-1", first.fingerprint)
    staying = [path for path in public_files if path.name != "hospital-3.public.toml"]
    second = assemble_roster(
        tmp_path / "v2", address=ADDRESS, public_files=staying, previous=tmp_path / "v1" / ROSTER_FILE
    )
    assert (second.version, second.previous) == (2, first.digest)
    shutil.copy(tmp_path / "v2" / ROSTER_FILE, federation / ROSTER_FILE)
    for name in ("server", "hospital-1"):  # hospital-2 has not signed yet
        assert sign_roster(tmp_path / "v2", Credentials.load(tmp_path / "machines" / name)) == ["hospital-3 leaves"]
    shutil.copy(tmp_path / "v2" / SIGNATURES_FILE, federation / SIGNATURES_FILE)
    with pytest.raises(RosterError, match="lacks hospital-2's signature"):
        join_federation(federation, "hospital-1", None)
    # A signature by another key (hospital-3's, which left) under hospital-2's name does not count.
    text = (federation / SIGNATURES_FILE).read_text()
    stolen = Credentials.load(tmp_path / "machines" / "hospital-3").identity.signing.sign(b"anything")
    (federation / SIGNATURES_FILE).write_text(text + f"hospital-2 = '{base64.b64encode(stolen).decode()}'\n")
    with pytest.raises(RosterError, match="hospital-2's signature .* does not verify"):
        join_federation(federation, "hospital-1", None)
    sign_roster(tmp_path / "v2", Credentials.load(tmp_path / "machines" / "hospital-2"))
    shutil.copy(tmp_path / "v2" / SIGNATURES_FILE, federation / SIGNATURES_FILE)
    assert join_federation(federation, "hospital-1", None)[0].hospitals == ["hospital-1", "hospital-2"]
    for name in ("server", "hospital-2"):
        confirm_roster(tmp_path / "v2", Credentials.load(tmp_path / "machines" / name), second.fingerprint)

    # The provisioner brings "hospital-3" back under keys of its own, and every party that stays signs:
    # each checked its own entry only, so none vouched for the newcomer's. Refused at signing and at start.
    impostor = generate_party_keys(tmp_path / "impostor", name="hospital-3", role="hospital")
    third = assemble_roster(
        tmp_path / "v3", address=ADDRESS, public_files=[*staying, impostor], previous=tmp_path / "v2" / ROSTER_FILE
    )
    with pytest.raises(RosterError, match="hospital-3 joins.*signatures cannot confirm it"):
        sign_roster(tmp_path / "v3", Credentials.load(tmp_path / "machines" / "server"))
    shutil.copy(tmp_path / "v3" / ROSTER_FILE, federation / ROSTER_FILE)
    for name in ("server", "hospital-1", "hospital-2"):  # signatures made all the same, without the tool's check
        credentials = Credentials.load(tmp_path / "machines" / name)
        signed = credentials.identity.signing.sign(b"consilium roster signature\x00" + bytes.fromhex(third.digest))
        text = (federation / SIGNATURES_FILE).read_text()
        (federation / SIGNATURES_FILE).write_text(
            re.sub(rf"{name} = '.*'", f"{name} = '{base64.b64encode(signed).decode()}'", text)
        )
    with pytest.raises(RosterError, match="hospital-3 joins.*compare its fingerprint"):
        join_federation(federation, "hospital-1", None)
    # Every signature there, but a version that does not name the one confirmed is not its successor.
    other = assemble_roster(
        tmp_path / "v3b", address=ADDRESS, public_files=staying[:2], previous=tmp_path / "v1" / ROSTER_FILE
    )
    shutil.copy(tmp_path / "v3b" / ROSTER_FILE, federation / ROSTER_FILE)
    assert other.previous == first.digest
    with pytest.raises(RosterError, match="nor does it name that one as previous"):
        join_federation(federation, "hospital-1", None)
    # The first version put back, with the fingerprint of the command that started it once: refused.
    shutil.copy(tmp_path / "v1" / ROSTER_FILE, federation / ROSTER_FILE)
    with pytest.raises(RosterError, match="older than version 2, which this party confirmed"):
        join_federation(federation, "hospital-1", first.fingerprint)


def test_a_replaced_copy_of_the_confirmed_roster_is_refused(tmp_path):
    """Someone who can write the party's folder, not its secret key, puts a roster of its own in both places."""
    public_files = _party_folders(tmp_path)
    honest = assemble_roster(tmp_path / "fed", address=ADDRESS, public_files=public_files)
    federation = _install(tmp_path, tmp_path / "fed", "hospital-1")
    join_federation(federation, "hospital-1", honest.fingerprint)
    rogue = assemble_roster(tmp_path / "rogue", address="tcp://evil.example.org:5555", public_files=public_files)
    for place in (federation / ROSTER_FILE, federation / "hospital-1" / ACCEPTED_ROSTER_FILE):
        shutil.copy(tmp_path / "rogue" / ROSTER_FILE, place)
    with pytest.raises(RosterError, match="damaged or was replaced"):
        join_federation(federation, "hospital-1", None)
    assert join_federation(federation, "hospital-1", rogue.fingerprint)[0].server_address.startswith(
        "tcp://evil"
    )  # only if confirmed


def test_a_party_refuses_a_roster_without_its_keys_or_with_shared_keys(tmp_path):
    public_files = _party_folders(tmp_path)
    roster = assemble_roster(tmp_path / "fed", address=ADDRESS, public_files=public_files)
    other = generate_party_keys(tmp_path / "other", name="hospital-1", role="hospital")
    with pytest.raises(RosterError, match="not this party's keys"):
        roster.check_own_entry(Credentials.load(other.parent))
    duplicate = tmp_path / "hospital-3.public.toml"  # hospital-1's keys under another name
    duplicate.write_text(public_files[1].read_text().replace("hospital-1", "hospital-3"))
    with pytest.raises(RosterError, match="two parties share a key"):
        assemble_roster(tmp_path / "dup", address=ADDRESS, public_files=[*public_files, duplicate])
    text = (tmp_path / "fed" / ROSTER_FILE).read_text()
    (tmp_path / "fed" / ROSTER_FILE).write_text(text + "\n[[party]]\n" + duplicate.read_text())
    with pytest.raises(RosterError, match="two parties share a key"):
        Roster.load(tmp_path / "fed")


def test_missing_or_malformed_files_are_named(tmp_path):
    with pytest.raises(RosterError, match="assemble it with consilium-provision"):
        Roster.load(tmp_path)
    with pytest.raises(KeyFileError, match="only a party new to the federation makes keys"):
        Credentials.load(tmp_path / "hospital-9")
    roster = local_federation(tmp_path / "fed", hospitals=1, address=ADDRESS)
    with pytest.raises(RosterError, match="not in the roster"):
        roster.party("hospital-9")
    roster_file = tmp_path / "fed" / ROSTER_FILE
    text = roster_file.read_text()
    for broken, message in (
        (text.replace("curve_public = '", "curve_public = 'x", 1), "40 z85 characters"),
        ("[server\n", "cannot read"),
        (text.replace("version = 1", "version = 2"), "must name a previous roster"),
        (text.replace("role = 'hospital'", "role = 'auditor'"), "has role 'auditor'"),
        (
            text.replace("name = 'hospital-1'", 'name = "hospital-1\\n"'),
            "a party name must be",
        ),  # prints as the real one
        (text.replace("[server]", "[servers]"), "needs \\[roster\\], \\[server\\]"),
    ):
        roster_file.write_text(broken)
        with pytest.raises(RosterError, match=message):
            Roster.load(tmp_path / "fed")


def test_a_public_file_named_where_it_is_not_gets_the_path_keygen_wrote_it_to(tmp_path):
    """As the deployment guide is typed on one machine: keygen wrote fed/NAME/NAME.public.toml."""
    generate_party_keys(tmp_path / "fed" / "server", name="server", role="server")
    with pytest.raises(KeyFileError, match=r"consilium-keygen wrote it to .*fed/server/server.public.toml"):
        assemble_roster(tmp_path / "fed", address=ADDRESS, public_files=[pathlib.Path("server.public.toml")])
    with pytest.raises(KeyFileError, match="the party makes it with consilium-keygen and sends it"):
        assemble_roster(tmp_path / "fed", address=ADDRESS, public_files=[pathlib.Path("hospital-1.public.toml")])


def test_local_federation_refuses_bad_input_before_making_any_key(tmp_path):
    for kwargs, message in (
        ({"hospitals": 0}, "at least one hospital"),
        ({"address": "localhost"}, "tcp://HOST:PORT"),
        ({"mpc_addresses": ("127.0.0.1:7001", "127.0.0.1:7002")}, "at least 3 talliers"),
        ({"mpc_addresses": ("127.0.0.1:7001", "127.0.0.1:7001", "127.0.0.1:7003")}, "its own MPC address"),
        ({"mpc_addresses": ("127.0.0.1:7001", "tcp://127.0.0.1:7002", "127.0.0.1:7003")}, "HOST:PORT"),
        ({"mpc_addresses": ("127.0.0.1:7001", "127.0.0.1:70000", "127.0.0.1:7003")}, "HOST:PORT"),
    ):
        with pytest.raises(KeyFileError, match=message):
            local_federation(tmp_path / "fed", **{"hospitals": 1, "address": ADDRESS, **kwargs})
        assert not (tmp_path / "fed").exists()
    local_federation(tmp_path / "fed", hospitals=1, address=ADDRESS)
    with pytest.raises(KeyFileError, match="holds a party's keys already"):
        local_federation(tmp_path / "fed", hospitals=1, address=ADDRESS)


def test_the_launchers_make_a_federation_as_the_readme_says(tmp_path):
    """consilium-keygen on each machine, consilium-provision from the public files, consilium-roster to check and sign."""
    machines = tmp_path / "machines"
    for role, name, extra in (
        ("server", "server", ()),
        ("hospital", "hospital-1", ()),
        ("tallier", "tallier-1", ("--mpc-address", "h:1")),
    ):
        made = run_launcher("keygen", "--role", role, "--name", name, "--out", machines / name, *extra)
        assert made.returncode == 0, made.stderr
    public_files = [machines / name / f"{name}.public.toml" for name in ("server", "hospital-1")]
    provisioned = run_launcher("provision", "--out", tmp_path / "fed", "--address", ADDRESS, *public_files)
    assert provisioned.returncode == 0, provisioned.stderr
    fingerprint = re.search(r"fingerprint: ([\d ]+)", provisioned.stdout).group(1).strip()
    at_hospital = _install(tmp_path, tmp_path / "fed", "hospital-1")
    checked = run_launcher("roster", "fingerprint", "--federation", at_hospital, "--name", "hospital-1")
    assert checked.returncode == 0 and f"fingerprint: {fingerprint}" in checked.stdout
    assert (
        confirm_roster(at_hospital, Credentials.load(at_hospital / "hospital-1"), fingerprint).fingerprint
        == fingerprint
    )
    signed = run_launcher(
        "roster", "sign", "--federation", at_hospital, "--name", "hospital-1"
    )  # a first roster is never signed
    assert (
        signed.returncode == 2
        and "follows the roster it confirmed last" in signed.stderr
        and "Traceback" not in signed.stderr
    )
