"""The settings loader: typed values from environment variables, errors naming them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpusched.libs.common import settings
from gpusched.libs.common.settings import Setting, SettingError, load

FIELDS: dict[str, Setting[Any]] = {
    "workers": Setting("APP_WORKERS", settings.integer(1, 64)),
    "scale": Setting("APP_SCALE", settings.number(0, above=True)),
    "verbose": Setting("APP_VERBOSE", settings.boolean()),
    "home": Setting("APP_HOME", settings.path()),
    "mode": Setting("APP_MODE", settings.one_of("fast", "slow")),
    "gpus": Setting("APP_GPUS", settings.integers(low=0)),
}


def test_set_variables_become_typed_values_and_unset_or_empty_ones_are_left_out():
    values = load(FIELDS, {
        "APP_WORKERS": " 8 ", "APP_SCALE": "0.5", "APP_VERBOSE": "Yes", "APP_HOME": "/srv",
        "APP_MODE": "FAST", "APP_GPUS": "0, 2", "APP_OTHER": "x",
    })
    assert values == {
        "workers": 8, "scale": 0.5, "verbose": True, "home": Path("/srv"), "mode": "fast",
        "gpus": (0, 2),
    }
    assert load(FIELDS, {"APP_WORKERS": "", "APP_SCALE": "  "}) == {}


@pytest.mark.parametrize(
    ("variable", "raw", "message"),
    [
        ("APP_WORKERS", "many", "APP_WORKERS: expected an integer in [1, 64], got 'many'"),
        ("APP_WORKERS", "65", "APP_WORKERS: expected an integer in [1, 64], got '65'"),
        ("APP_SCALE", "abc", "APP_SCALE: expected a number > 0, got 'abc'"),
        ("APP_SCALE", "0", "APP_SCALE: expected a number > 0, got '0'"),
        ("APP_SCALE", "nan", "APP_SCALE: expected a number > 0, got 'nan'"),
        ("APP_VERBOSE", "maybe", "APP_VERBOSE: expected one of 1, true, yes, on, 0, false"),
        ("APP_MODE", "medium", "APP_MODE: expected one of fast, slow, got 'medium'"),
        ("APP_GPUS", "0,-1", "APP_GPUS: expected comma-separated integers >= 0, got '0,-1'"),
    ],
)
def test_a_bad_value_is_refused_naming_its_variable(variable: str, raw: str, message: str):
    with pytest.raises(SettingError) as caught:
        load(FIELDS, {variable: raw})
    assert str(caught.value).startswith(message)
    assert caught.value.variable == variable
