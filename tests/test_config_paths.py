"""Model paths are checked before anything starts: a relative path is read from the YAML's folder, then the
working directory; a name that is no folder is a hub ID only if it has that form; anything else is refused
at once, naming the key and the paths tried. (A copied deploy/local.yaml used to start Ray, wait about 60 s
and die with Ray's own error while the worker's real error never reached the user.)"""
import shutil
import time
from pathlib import Path

import pytest
import yaml

from router import cli, launch
from settings.schema import ConfigError, config_from_dict, load_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def no_ray(monkeypatch):
    def refuse(config):
        raise AssertionError("Ray was started for a config that should have been refused")
    monkeypatch.setattr(launch, "connect", refuse)


def test_copied_local_config_fails_fast_naming_the_key(tmp_path, monkeypatch, capsys, no_ray):
    copied = tmp_path / "elsewhere" / "local.yaml"
    copied.parent.mkdir()
    shutil.copy(ROOT / "deploy" / "local.yaml", copied)
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    for command in (["serve", "--config", str(copied)], ["demo", "--config", str(copied), "hi"]):
        assert cli.main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith("config error: draft.model: no model folder 'models/demo-pair/draft' (tried "), err
        assert str(copied.parent / "models/demo-pair/draft") in err and str(tmp_path / "models/demo-pair/draft") in err
    assert time.monotonic() - started < 10          # refused, not a Ray timeout (60 s) later


def test_relative_path_is_read_from_the_yaml_folder_then_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "draft").mkdir()
    (tmp_path / "cwd" / "target").mkdir(parents=True)
    path = tmp_path / "conf" / "specpool.yaml"
    path.write_text(yaml.safe_dump({"draft": {"model": "draft"}, "target": {"model": "./target"}}))
    monkeypatch.chdir(tmp_path / "cwd")
    config = load_config(path)
    assert config.draft.model == str(tmp_path / "conf" / "draft")
    assert config.target.model == str(tmp_path / "cwd" / "target")


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.1-70B-Instruct", "gpt2", "builtin:random-pair/draft"])
def test_hub_ids_and_builtin_pairs_are_taken_as_they_are(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_from_dict({"draft": {"model": model}}).draft.model == model


@pytest.mark.parametrize("model", ["models/demo-pair/draft", "/nonexistent/model", "./draft", "../x/y", "a--b/c"])
def test_missing_paths_that_are_no_hub_id_are_refused(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^target\.model: no model folder .* \(tried "):
        config_from_dict({"target": {"model": model}}, tmp_path / "conf")


def test_a_hold_longer_than_the_routers_wait_for_an_answer_is_refused_naming_both_keys(tmp_path):
    """Held answers must come back within router.worker_timeout_s, or every held decode run would time out."""
    config = {"router": {"worker_timeout_s": 5}, "speculation": {"unstreamed_answer_delay_ms": 6000},
              "draft": {"model": "gpt2"}, "target": {"model": "gpt2"}}
    with pytest.raises(ConfigError, match=r"^speculation\.unstreamed_answer_delay_ms: must be shorter than "
                                          r"router\.worker_timeout_s=5 s \(got 6000 ms\)"):
        config_from_dict(config, tmp_path)
