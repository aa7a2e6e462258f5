import dataclasses

import pytest

from posttrain import cli
from posttrain.core import check_compatibility, format_report


def test_compatibility_matrix_flags_torchao_016_with_torchtune_061():
    problems = check_compatibility({"torchtune": "0.6.1", "torchao": "0.16.0", "torch": "2.13.0"})
    assert len(problems) == 1
    assert "torchao 0.16.0 with torchtune 0.6.1" in problems[0]
    assert "torchao==0.15.0" in problems[0]


def test_compatibility_matrix_accepts_the_pinned_stack():
    assert (
        check_compatibility(
            {
                "torchtune": "0.6.1",
                "torchao": "0.15.0",
                "torch": "2.13.0+cpu",
                "verl": "0.9.1",
                "transformers": "5.10.4",
            }
        )
        == []
    )


def test_compatibility_matrix_flags_transformers_511_with_verl():
    problems = check_compatibility({"verl": "0.9.1", "transformers": "5.11.0"})
    assert problems and "transformers<5.11" in problems[0]


def test_info_report_lists_the_stack():
    text, ok = format_report()
    for name in (
        "torch",
        "torchtune",
        "torchao",
        "verl",
        "transformers",
        "submitit",
        "device",
        "threads",
    ):
        assert name in text
    assert ok


def test_info_command_exit_code(capsys):
    assert cli.main(["info"]) == 0
    assert "compatibility: ok" in capsys.readouterr().out


@dataclasses.dataclass(kw_only=True)
class _Cfg:
    steps: int = 3
    lr: float = 1e-3
    name: str = "x"
    flag: bool = False
    maybe: int | None = None


def test_overrides_are_typed_by_annotations():
    cfg = cli.apply_overrides(_Cfg(), ["steps=7", "lr=0.5", "name=abc", "flag=true", "maybe=none"])
    assert cfg == _Cfg(steps=7, lr=0.5, name="abc", flag=True, maybe=None)
    assert cli.apply_overrides(_Cfg(), ["maybe=4"]).maybe == 4


def test_unknown_override_names_the_valid_keys():
    with pytest.raises(ValueError, match="unknown config key 'step'.*steps"):
        cli.apply_overrides(_Cfg(), ["step=1"])
    with pytest.raises(ValueError, match="key=value"):
        cli.apply_overrides(_Cfg(), ["steps"])
    with pytest.raises(ValueError, match="'flag'.*boolean"):
        cli.apply_overrides(_Cfg(), ["flag=maybe"])


@dataclasses.dataclass(kw_only=True)
class _Optim:
    lr: float = 1e-3
    steps: int = 3
    clip: float | None = 1.0


@dataclasses.dataclass(kw_only=True)
class _Nested:
    optim: _Optim = dataclasses.field(default_factory=_Optim)
    options: dict = dataclasses.field(default_factory=lambda: {"a": 1, "b": 2})
    name: str = "x"


def test_dotted_overrides_reach_nested_sections_typed_by_their_fields():
    cfg = cli.apply_overrides(
        _Nested(), ["optim.lr=1e-4", "optim.steps=7", "optim.clip=none", "options.b=5", "name=y"]
    )
    assert cfg == _Nested(
        optim=_Optim(lr=1e-4, steps=7, clip=None), options={"a": 1, "b": 5}, name="y"
    )
    assert isinstance(cfg.optim.lr, float) and _Nested().optim == _Optim()  # defaults untouched
    # a mapping for a section sets those keys; a mapping for a dict field replaces it
    cfg = cli.apply_overrides(_Nested(), ["optim={steps: 9}", "options={c: 3}"])
    assert cfg.optim == _Optim(steps=9) and cfg.options == {"c": 3}


def test_unknown_nested_key_lists_the_valid_keys_of_its_section():
    with pytest.raises(
        ValueError,
        match=r"unknown config key 'optim\.lrr'; valid keys of optim: "
        r"clip, lr, steps",
    ):
        cli.apply_overrides(_Nested(), ["optim.lrr=1"])
    with pytest.raises(
        ValueError,
        match=r"unknown config key 'optimizer\.lr'; valid keys: name, "
        r"optim, options",
    ):
        cli.apply_overrides(_Nested(), ["optimizer.lr=1"])
    with pytest.raises(ValueError, match=r"'optim\.steps'.*invalid literal"):
        cli.apply_overrides(_Nested(), ["optim.steps=many"])
    with pytest.raises(ValueError, match=r"'name\.first': 'name' has no keys"):
        cli.apply_overrides(_Nested(), ["name.first=1"])


def test_yaml_preset_nests_sections_and_rejects_unknown_keys(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("optim: {lr: 0.5}\noptim.steps: 4\nname: z\n")
    assert cli.load_config_file(_Nested(), str(preset)) == _Nested(
        optim=_Optim(lr=0.5, steps=4), name="z"
    )
    preset.write_text("optim: {lr: 0.5, warmup: 3}\n")
    with pytest.raises(
        ValueError,
        match=r"p\.yaml: unknown config key 'optim\.warmup'; valid "
        r"keys of optim: clip, lr, steps",
    ):
        cli.load_config_file(_Nested(), str(preset))


def test_unknown_recipe_lists_the_available_ones():
    with pytest.raises(ValueError, match="unknown recipe 'nope'; available: .*demo"):
        cli.find_recipe("nope")


def test_recipe_by_path(tmp_path):
    recipe = tmp_path / "r.py"
    recipe.write_text(
        "from dataclasses import dataclass\n@dataclass(kw_only=True)\nclass Config:\n"
        "    steps: int = 1\n    tag: str = 'a'\n"
        "def main(cfg):\n    open(cfg.tag, 'w').write(str(cfg.steps))\n"
    )
    preset = tmp_path / "p.yaml"
    preset.write_text("steps: 5\n")
    out = tmp_path / "out.txt"
    assert cli.main(["run", str(recipe), "--config", str(preset), f"tag={out}"]) == 0
    assert out.read_text() == "5"
    bad = tmp_path / "bad.yaml"
    bad.write_text("stepz: 5\n")
    with pytest.raises(SystemExit):
        cli.main(["run", str(recipe), "--config", str(bad)])
    with pytest.raises(ValueError, match="does not exist"):
        cli.find_recipe(str(tmp_path / "missing.py"))


def test_config_file_errors_are_usage_errors(tmp_path, capsys):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("a: [1\n")
    for path, message in (
        (tmp_path / "missing.yaml", "No such file"),
        (bad_yaml, "not valid YAML"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["run", "demo", "--config", str(path)])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


_BUILT: list[str] = []


@dataclasses.dataclass(kw_only=True)
class _Counted(_Nested):
    """A config that counts its constructions (each validates it once)."""

    def __post_init__(self) -> None:
        _BUILT.append(self.name)


def test_a_preset_and_the_overrides_build_the_config_once_in_order(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("optim: {lr: 0.5, steps: 4}\noptions: {z: 1}\nname: z\n")
    _BUILT.clear()
    cfg = cli.apply_overrides(
        _Counted(), ["optim.steps=9", "options.c=3", "name=y"], config_file=str(preset)
    )
    assert _BUILT == ["x", "y"]  # the defaults, then one construction for all changes
    # the preset's section keys stay where an override sets others; a later value wins; a dict
    # field is replaced by the preset's mapping, and a dotted key then sets one entry of it
    assert cfg == _Counted(optim=_Optim(lr=0.5, steps=9), options={"z": 1, "c": 3}, name="y")
    # a later mapping for a section sets its keys over the earlier ones; for a dict field it
    # replaces the earlier mapping
    cfg = cli.apply_overrides(
        _Nested(), ["optim={steps: 7}", "options={c: 3}"], config_file=str(preset)
    )
    assert cfg.optim == _Optim(lr=0.5, steps=7) and cfg.options == {"c": 3}
    # defaults (a rerun's) come first, then the preset, then the overrides
    cfg = cli.apply_overrides(_Nested(), ["name=w"], defaults={"name": "d", "optim.clip": None})
    assert (cfg.name, cfg.optim.clip) == ("w", None)
    assert cli.apply_overrides(_Nested(), [], config_file=str(preset)) == cli.load_config_file(
        _Nested(), str(preset)
    )


def test_a_bad_parallel_override_with_a_preset_is_named_by_its_dotted_field(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("parallel: {tp: 1}\nseed: 3\n")
    config = cli.load_recipe("sft").Config
    with pytest.raises(ValueError, match=r"^Config\.parallel\.dp_shard=0"):
        cli.apply_overrides(config(), ["parallel.dp_shard=0"], config_file=str(preset))
    with pytest.raises(ValueError, match=r"Config\.parallel does not fit Config\.model: "):
        cli.apply_overrides(config(), ["parallel.tp=3"], config_file=str(preset))
