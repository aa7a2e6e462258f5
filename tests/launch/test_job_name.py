"""A job's default name (`posttrain.launch.submit._job_name`): `<file>.<function>`, read from the
file that defines the function, so launch needs to know nothing of how the layer above it names
the modules it loads (a recipe file is imported as `posttrain_recipe_sft`; its job is `sft.main`).
"""

from __future__ import annotations

import importlib.util
import json
import sys

from posttrain.launch.submit import _job_name, launch
from posttrain.workflows.recipes import load_recipe


def test_a_recipe_loaded_by_name_is_named_after_its_file():
    module = load_recipe("sft")
    assert module.__name__ == "posttrain_recipe_sft"  # the loader's made-up module name
    assert _job_name(module.main) == "sft.main"


def test_any_module_under_a_made_up_name_is_named_after_its_file(tmp_path, monkeypatch):
    path = tmp_path / "my_job.py"
    path.write_text("def run(cfg):\n    return cfg\n")
    spec = importlib.util.spec_from_file_location("loaded_as_something_else", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    assert _job_name(module.run) == "my_job.run"


def test_modules_packages_main_and_unloaded_modules():
    assert _job_name(launch) == "submit.launch"  # posttrain/launch/submit.py
    assert _job_name(json.dumps) == "json.dumps"  # a package: json/__init__.py
    assert _job_name(len) == "len"  # builtins

    def in_main():
        pass

    in_main.__module__ = "__main__"
    assert _job_name(in_main) == "in_main"
    namespace: dict = {"__name__": "not.loaded_here"}
    exec("def f():\n    pass\n", namespace)
    assert _job_name(namespace["f"]) == "loaded_here.f"
    assert _job_name(lambda: 0) == "test_job_name.lambda"
