"""Cross-process settings checked before anything starts (asyncrl/config_check.py), `asyncrl
keygen`, and key rotation: workers accept an old and a new public key during a window."""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest

from asyncrl import config_check, keygen
from delta_codec import DeltaError, signing
from kernel.config import ConfigError

GOOD = {
    "up": {"workers": 1, "steps": 3},
    "trainer": {"batch": {"max_lag": 4}},
    "worker": {"admission": {"max_lag": 4}},
    "scorer": {},
}


def check(conf):
    config_check.cross_check(config_check.resolve(conf, environ={}))


def test_good_config_passes():
    check(GOOD)


def test_unknown_up_key_is_refused():
    with pytest.raises(ConfigError, match=r"\[up\] unknown key 'wrokers'; did you mean 'workers'\?"):
        check({**GOOD, "up": {"wrokers": 2}})


def test_max_lag_disagreement_names_both_sides():
    lag8 = {**GOOD, "worker": {"admission": {"max_lag": 8}}}
    with pytest.raises(ConfigError, match=r"\[trainer.batch\] max_lag = 4, \[worker.admission\] max_lag = 8"):
        check(lag8)
    config_check.resolve(lag8, environ={}, sync=True)  # a sync run: no lag, nothing to agree on
    config_check.resolve({**lag8, "up": {**GOOD["up"], "sync": True}}, environ={})


def test_skip_uniform_groups_is_refused_for_a_sync_run():
    skip = {**GOOD, "trainer": {"batch": {"max_lag": 4, "skip_uniform": True}}}
    check(skip)  # async: fine
    with pytest.raises(ConfigError, match=r"skip_uniform = true is async only"):
        config_check.cross_check(config_check.resolve(skip, environ={}), sync=True)


def test_tokenizer_disagreement(tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    with pytest.raises(
        ConfigError,
        match=r"\[trainer.policy\] tokenizer = 'char', \[worker.engine\] tokenizer = .*tokenizer.json",
    ):
        check({**GOOD, "worker": {"admission": {"max_lag": 4}, "engine": {"tokenizer": str(tok)}}})


def test_signing_pair_must_match(tmp_path):
    k1, p1 = keygen.write_keypair(tmp_path, "a")
    _k2, p2 = keygen.write_keypair(tmp_path, "b")
    check(
        {
            **GOOD,
            "trainer": {"batch": {"max_lag": 4}, "publish": {"signing_key": str(k1)}},
            "worker": {"admission": {"max_lag": 4}, "weights": {"public_key": str(p1)}},
        }
    )
    with pytest.raises(
        ConfigError,
        match=r"signing key pair disagrees: \[trainer.publish\] signing_key = .*a.key.*"
        r"\[worker.weights\] public_key = .*b.pub",
    ):
        check(
            {
                **GOOD,
                "trainer": {"batch": {"max_lag": 4}, "publish": {"signing_key": str(k1)}},
                "worker": {"admission": {"max_lag": 4}, "weights": {"public_key": str(p2)}},
            }
        )
    with pytest.raises(ConfigError, match=r"\[trainer.publish\] signing_key is empty"):
        check({**GOOD, "worker": {"admission": {"max_lag": 4}, "weights": {"public_key": str(p1)}}})
    # rotation window: the worker's key file lists old and new keys; either trainer key passes
    both = tmp_path / "both.pub"
    both.write_text(p2.read_text() + p1.read_text())
    check(
        {
            **GOOD,
            "trainer": {"batch": {"max_lag": 4}, "publish": {"signing_key": str(k1)}},
            "worker": {"admission": {"max_lag": 4}, "weights": {"public_key": str(both)}},
        }
    )


def test_up_refuses_before_starting_anything(tmp_path):
    cfg = tmp_path / "up.toml"
    cfg.write_text("[up]\nsteps = 2\n[trainer.batch]\nmax_lag = 2\n[worker.admission]\nmax_lag = 6\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "up",
            "--config",
            str(cfg),
            "--run-dir",
            str(tmp_path / "run"),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert (
        "bad configuration: max_lag disagrees: [trainer.batch] max_lag = 2, [worker.admission] max_lag = 6"
        in r.stderr
    )
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_config_check_cli(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[up]\nworkers = 1\n[trainer.batch]\nmax_lag = 3\n[worker.admission]\nmax_lag = 3\n")
    r = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "config", "check", str(cfg)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert (
        "[trainer]" in r.stdout
        and "[worker]" in r.stdout
        and "[scorer]" in r.stdout
        and '"max_lag": 3' in r.stdout
    )
    cfg.write_text("[trainer]\nlrr = 1\n[trainer.batch]\nmax_lag = 3\n")
    r = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "config", "check", str(cfg)], capture_output=True, text=True
    )
    assert r.returncode == 2 and "[trainer] unknown key 'lrr'; did you mean [trainer.optim] lr?" in r.stderr


def test_keygen_writes_a_private_pair(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "keygen", "--out", str(tmp_path / "k")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    key, pub = tmp_path / "k" / "trainer-signing.key", tmp_path / "k" / "trainer-signing.pub"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    sig = signing.sign(key.read_text().strip(), b"payload")
    signing.verify(pub.read_text().strip(), b"payload", sig)
    r = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "keygen", "--out", str(tmp_path / "k")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "refusing to overwrite" in r.stderr
    assert signing.sign(key.read_text().strip(), b"payload") == sig  # the old key is untouched


def test_rotation_keyring_accepts_old_and_new_only():
    old_sk, old_pk = signing.generate_keypair()
    new_sk, new_pk = signing.generate_keypair()
    other_sk, _ = signing.generate_keypair()
    ring = signing.public_key(f"{old_pk.hex()}\n{new_pk.hex()}")
    for sk in (old_sk, new_sk):
        signing.verify(ring, b"delta", signing.sign(sk, b"delta"))
    with pytest.raises(DeltaError):
        signing.verify(ring, b"delta", signing.sign(other_sk, b"delta"))
    with pytest.raises(DeltaError):
        signing.verify(ring, b"altered", signing.sign(new_sk, b"delta"))
    signing.verify([old_pk, new_pk], b"x", signing.sign(new_sk, b"x"))  # a list works too
