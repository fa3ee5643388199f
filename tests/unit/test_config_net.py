"""The network section's rules: a host is an address, CURVE comes with a client allow-list, keys
are keys -- each refused at config time with its field path, never as a traceback at bind."""

import os
import stat

import pytest

from core import config as C
from core import net

SPUB, SSEC = net.make_curve_keys()
CPUB, CSEC = net.make_curve_keys()


def curve(*extra, allow=f'"{CPUB}"'):
    return [f'net.curve_server_public="{SPUB}"', f'net.curve_server_secret="{SSEC}"',
            f"net.curve_client_public={allow}", f'net.curve_client_secret="{CSEC}"', *extra]


@pytest.mark.parametrize("host", ["127.evil", "buffer.internal", "::1", "300.1.1.1", ""])
def test_a_host_that_is_not_an_ipv4_address_or_localhost_is_refused(host):
    with pytest.raises(C.ConfigError, match=r"\$\.net\.host"):
        C.load(None, [f'net.host="{host}"', *curve()])


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.4.5", "localhost"])
def test_loopback_hosts_need_no_curve(host):
    assert C.load(None, [f'net.host="{host}"']).net.host == host


def test_non_loopback_needs_curve_server_keys_and_a_client_allow_list():
    with pytest.raises(C.ConfigError, match="CURVE"):
        C.load(None, ["net.host=0.0.0.0"])
    with pytest.raises(C.ConfigError, match=r"\$\.net\.curve_client_public"):
        C.load(None, ["net.host=0.0.0.0", f'net.curve_server_public="{SPUB}"', f'net.curve_server_secret="{SSEC}"'])
    with pytest.raises(C.ConfigError, match=r"\$\.net\.curve_server_secret"):
        C.load(None, ["net.host=0.0.0.0", f'net.curve_server_public="{SPUB}"', f'net.curve_client_public="{CPUB}"'])
    cfg = C.load(None, ["net.host=10.1.2.3", *curve()])
    assert net.client_keys(cfg.net) == [CPUB]


def test_curve_on_loopback_needs_the_allow_list_too():
    with pytest.raises(C.ConfigError, match=r"\$\.net\.curve_client_public"):
        C.load(None, [f'net.curve_server_public="{SPUB}"', f'net.curve_server_secret="{SSEC}"'])


def test_the_allow_list_may_be_a_list_and_a_client_derives_its_public_key():
    other, _ = net.make_curve_keys()
    cfg = C.load(None, ["net.host=0.0.0.0", *curve(allow=f'["{other}", "{CPUB}"]')])
    assert net.client_keys(cfg.net) == [other, CPUB]
    assert net.curve_from_config(cfg.net).client_public == CPUB.encode()  # from curve_client_secret
    assert C.from_json(C.to_json(cfg)) == cfg


@pytest.mark.parametrize("field, value", [
    ("curve_server_public", '"not a key"'), ("curve_client_secret", '"x"'),
    ("curve_client_public", f'["{CPUB}", "short"]')])
def test_a_malformed_key_names_its_field(field, value):
    overrides = [o for o in curve("net.host=0.0.0.0") if not o.startswith(f"net.{field}=")]
    with pytest.raises(C.ConfigError) as e:
        C.load(None, [*overrides, f"net.{field}={value}"])
    want = "$.net.curve_client_public[1]" if field == "curve_client_public" else f"$.net.{field}"
    assert want in str(e.value) and "z85" in str(e.value)


def test_max_prompt_tokens_is_a_positive_buffer_limit():
    assert C.load().buffer.max_prompt_tokens == 4096
    with pytest.raises(C.ConfigError, match=r"\$\.buffer\.max_prompt_tokens"):
        C.load(None, ["buffer.max_prompt_tokens=0"])


# ---- the per-run secret ----------------------------------------------------------------------


def test_the_run_secret_is_created_once_private_and_returned_on_resume(tmp_path):
    token = net.create_run_secret(str(tmp_path))
    path = tmp_path / net.SECRET_FILE
    assert len(token) == 64 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert net.create_run_secret(str(tmp_path)) == token == net.run_secret(str(tmp_path))
    assert net.create_run_secret(str(tmp_path / ".." / tmp_path.name)) == token


@pytest.mark.parametrize("damage, match", [
    ("missing", "no run secret"), ("mode", "0640"), ("symlink", "cannot open"), ("content", "damaged"),
    ("owner", "belongs to uid 65534")])
def test_a_run_secret_that_others_could_read_or_plant_is_refused(tmp_path, damage, match):
    path = tmp_path / net.SECRET_FILE
    if damage != "missing":
        net.create_run_secret(str(tmp_path))
    if damage == "mode":
        os.chmod(path, 0o640)
    elif damage == "symlink":
        real = tmp_path / "elsewhere"
        os.rename(path, real)
        os.symlink(real, path)
    elif damage == "content":
        path.write_text("guessable")
    elif damage == "owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the file to another user")
        os.chown(path, 65534, -1)
    with pytest.raises(RuntimeError, match=match):
        net.run_secret(str(tmp_path))
