"""`import posttrain` for notebooks: the common names, loaded lazily."""

import subprocess
import sys

import pytest
from _waits import WAIT_S

import posttrain

HEAVY = ("torch", "torchtune", "verl", "transformers", "reasoning_gym")


def test_import_posttrain_loads_nothing_heavy():
    code = (
        f"import sys, posttrain; dir(posttrain); print([m for m in {HEAVY!r} if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("name", posttrain.__all__)
def test_every_lazy_name_resolves_to_the_subpackage_object(name):
    import importlib

    value = getattr(posttrain, name)
    assert value is getattr(importlib.import_module(posttrain._LAZY[name]), name)


def test_an_unknown_name_says_what_is_there():
    with pytest.raises(AttributeError, match="no attribute 'Polciy'.*Policy"):
        posttrain.Polciy  # noqa: B018


def test_get_loss_from_the_top_knows_the_preference_losses():
    assert {"sft_ce", "dpo", "ipo", "simpo", "kto", "orpo", "bradley_terry"} <= set(
        posttrain.registered_losses()
    )


def test_package_re_exports_load_on_first_use():
    """`import posttrain.core` / `posttrain.rewards` (and the verifiers) import no torch; a name
    asked for loads its submodule; two submodules exporting one name is refused."""
    from posttrain.core.lazy import lazy_exports

    code = (
        "import sys, posttrain.core, posttrain.rewards, posttrain.verifiers, "
        "posttrain.core.threads\nprint('torch' in sys.modules)\n"
        "from posttrain.core import Registry\nfrom posttrain.rewards import Outcome\n"
        "print(Registry.__module__, Outcome.__module__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S, check=True
    ).stdout.split("\n")
    assert out[0] == "False"
    assert out[1] == "posttrain.core.registry posttrain.rewards.outcome"
    with pytest.raises(ValueError, match="'x' is exported by both 'a' and 'b'"):
        lazy_exports("posttrain.core", {"a": ["x"], "b": ["x"]})
    getattr_, names = lazy_exports("posttrain.core", {"checks": ["check_int"]})
    assert names == ["check_int"]
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        getattr_("nope")
