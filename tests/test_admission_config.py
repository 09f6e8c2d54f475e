"""AdmissionConfig: validation, the environment and the tokens file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpusched.services.admission.config import AdmissionConfig

URL = "nats://127.0.0.1:4222"


def test_the_environment_gives_url_address_tokens_and_quotas(tmp_path: Path):
    config = AdmissionConfig.from_env(
        {
            "NATS_URL": "nats://bus:4222",
            "GPUSCHED_HTTP_HOST": "0.0.0.0",
            "GPUSCHED_HTTP_PORT": "9000",
            "GPUSCHED_TOKENS": "tok1=alpha, tok2=beta",
            "GPUSCHED_QUOTAS": "alpha=8",
            "GPUSCHED_DATA_DIR": str(tmp_path),
        }
    )

    assert config.nats_url == "nats://bus:4222"
    assert (config.host, config.port) == ("0.0.0.0", 9000)
    assert config.tokens == {"tok1": "alpha", "tok2": "beta"}
    assert config.quotas == {"alpha": 8}
    assert config.data_dir == tmp_path
    assert not config.open


def test_an_empty_environment_runs_open_on_the_defaults():
    config = AdmissionConfig.from_env({})

    assert config.nats_url == URL
    assert (config.host, config.port) == ("127.0.0.1", 8080)
    assert config.open
    assert config.max_body_bytes == 65536


def test_a_token_may_hold_equals_signs():
    config = AdmissionConfig.from_env({"GPUSCHED_TOKENS": "dG9r==alpha"})
    assert config.tokens == {"dG9r=": "alpha"}


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_the_tokens_file_gives_tokens_and_quotas_in_yaml_or_json(tmp_path: Path, suffix: str):
    document = {"tokens": {"tok1": "alpha", "tok2": "beta"}, "quotas": {"alpha": 16}}
    path = tmp_path / f"tokens{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(document))
    else:
        path.write_text("tokens:\n  tok1: alpha\n  tok2: beta\nquotas:\n  alpha: 16\n")

    config = AdmissionConfig.from_env(
        {"GPUSCHED_TOKENS_FILE": str(path), "GPUSCHED_TOKENS": "tok3=gamma"}
    )

    assert config.tokens == {"tok1": "alpha", "tok2": "beta", "tok3": "gamma"}
    assert config.quotas == {"alpha": 16}


def test_a_token_given_to_two_tenants_is_refused(tmp_path: Path):
    path = tmp_path / "tokens.yaml"
    path.write_text("tokens:\n  tok1: alpha\n")

    with pytest.raises(ValueError, match="GPUSCHED_TOKENS: a token is given to two tenants"):
        AdmissionConfig.from_env(
            {"GPUSCHED_TOKENS_FILE": str(path), "GPUSCHED_TOKENS": "tok1=beta"}
        )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tokens: [a, b]\n", "tokens: must map"),
        ("quotas:\n  alpha: lots\n", "quotas.alpha"),
        ("tenants: {}\n", "unknown keys"),
        ("- a\n", "must hold a mapping"),
        ("tokens: {a: [b\n", "not valid YAML"),
    ],
)
def test_a_bad_tokens_file_is_refused_naming_what_is_wrong(
    tmp_path: Path, text: str, message: str
):
    path = tmp_path / "tokens.yaml"
    path.write_text(text)

    with pytest.raises(ValueError, match=message) as raised:
        AdmissionConfig.from_env({"GPUSCHED_TOKENS_FILE": str(path)})
    assert "GPUSCHED_TOKENS_FILE" in str(raised.value)


def test_a_missing_tokens_file_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match=r"GPUSCHED_TOKENS_FILE .*cannot read"):
        AdmissionConfig.from_env({"GPUSCHED_TOKENS_FILE": str(tmp_path / "absent.yaml")})


@pytest.mark.parametrize(
    ("environ", "field"),
    [
        ({"GPUSCHED_HTTP_PORT": "eighty"}, "GPUSCHED_HTTP_PORT"),
        ({"GPUSCHED_HTTP_PORT": "70000"}, "port"),
        ({"GPUSCHED_TOKENS": "justatoken"}, "GPUSCHED_TOKENS"),
        ({"GPUSCHED_QUOTAS": "alpha=many"}, "GPUSCHED_QUOTAS"),
        ({"GPUSCHED_MAX_BODY_BYTES": "10"}, "max_body_bytes"),
        ({"NATS_URL": "http://bus:4222"}, "nats_url"),
    ],
)
def test_a_bad_environment_variable_is_refused_naming_it(environ: dict[str, str], field: str):
    with pytest.raises(ValueError, match=f"^{field}:"):
        AdmissionConfig.from_env(environ)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"nats_url": ""}, "nats_url"),
        ({"host": ""}, "host"),
        ({"port": -1}, "port"),
        ({"port": True}, "port"),
        ({"tokens": {"": "alpha"}}, "tokens"),
        ({"tokens": {"tok": "has space"}}, "tokens"),
        ({"quotas": {"alpha": -1}}, "quotas"),
        ({"quotas": {"alpha": 1.5}}, "quotas"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"data_dir": Path("/no/such/directory")}, "data_dir"),
    ],
)
def test_a_bad_setting_is_refused_naming_the_field(changes: dict[str, Any], field: str):
    with pytest.raises(ValueError, match=f"^{field}:"):
        AdmissionConfig(**{"nats_url": URL, **changes})


def test_the_config_keeps_its_own_copy_of_tokens_and_quotas():
    tokens = {"tok": "alpha"}
    quotas = {"alpha": 2}
    config = AdmissionConfig(nats_url=URL, tokens=tokens, quotas=quotas)

    tokens["other"] = "beta"
    quotas["alpha"] = 100

    assert config.tokens == {"tok": "alpha"}
    assert config.quotas == {"alpha": 2}
