"""What serve tells its operator about reloads and admin output, with no Ray: a reload's log line says what changed
(the same for Admin.Reload and SIGHUP), a refusal names both values, and a closed pipe ends an admin command quietly."""
import asyncio
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from router.reload import RestartRequired, check_reloadable, config_changes, logged_reload
from settings.schema import ConfigError, config_from_dict

ROOT = Path(__file__).resolve().parents[1]


def test_a_reload_is_logged_as_what_changed():
    old = config_from_dict({"speculation": {"k": 4}, "draft": {"method": "model"}})
    new = config_from_dict({"speculation": {"k": 2}, "draft": {"method": "ngram"}})
    assert config_changes(old, new) == ["draft.method model -> ngram", "speculation.k 4 -> 2"]
    assert config_changes(old, old) == []


def test_a_reload_touching_the_api_keys_neither_logs_nor_answers_them():
    """The log line of a reload and a refusal's message showed both values of every key: bearer keys included."""
    old = config_from_dict({"http": {"api_keys": ["sk-running"]}})
    new = config_from_dict({"http": {"api_keys": ["sk-new"]}})
    assert config_changes(old, new) == ["http.api_keys <redacted> -> <redacted>"]
    with pytest.raises(RestartRequired) as refused:
        check_reloadable(old, new)
    assert str(refused.value) == ("http.api_keys: changing this needs a restart (running <redacted>, this document "
                                  "<redacted>)")
    with pytest.raises(RestartRequired) as turned_on:        # that no key runs is no secret
        check_reloadable(config_from_dict({}), new)
    assert str(turned_on.value) == "http.api_keys: changing this needs a restart (running [], this document <redacted>)"
    with pytest.raises(ConfigError) as invalid:
        config_from_dict({"http": {"api_keys": ["sk-kept", ""]}})
    assert "sk-kept" not in str(invalid.value)


class Reloading:
    """A router's reload as the log sees it: the config before and after, or a refusal."""

    def __init__(self, refusal: Exception | None = None):
        self.config, self.refusal = config_from_dict({}), refusal

    async def reload(self, data: dict, config_dir) -> None:
        if self.refusal:
            raise self.refusal
        self.config = dataclasses.replace(self.config, speculation=dataclasses.replace(self.config.speculation,
                                                                                       k=data["k"]))


@pytest.mark.parametrize("data, line", [({"k": 2}, "reloaded by Admin.Reload (specpool reload): speculation.k 4 -> 2"),
                                        ({"k": 4}, "reloaded by Admin.Reload (specpool reload): no change")])
def test_a_reload_logs_one_line_saying_what_changed_or_no_change(data, line, capsys):
    asyncio.run(logged_reload(Reloading(), lambda: data, None, "by Admin.Reload (specpool reload)"))
    assert capsys.readouterr().out.strip().endswith(line)


def test_a_refused_reload_logs_its_reason(capsys):
    with pytest.raises(ConfigError):
        asyncio.run(logged_reload(Reloading(ConfigError("speculation.k: must be >= 0")), lambda: {}, None,
                                  "deploy/local.yaml (SIGHUP)"))
    assert capsys.readouterr().out.strip().endswith(
        "reload deploy/local.yaml (SIGHUP) refused, running config kept: speculation.k: must be >= 0")


def test_a_refusal_names_the_running_value_and_the_documents_and_says_an_absent_key_is_a_default():
    running = config_from_dict({"router": {"metrics_port": 9171}})
    document = {"speculation": {"k": 2}}
    with pytest.raises(RestartRequired) as refused:
        check_reloadable(running, config_from_dict(document), document=document)
    assert str(refused.value) == ("router.metrics_port: changing this needs a restart (running 9171, this document "
                                  "-1: the default, as the key is absent)")
    written = {"router": {"metrics_port": 9200}}
    with pytest.raises(RestartRequired) as refused:
        check_reloadable(running, config_from_dict(written), document=written)
    assert str(refused.value).endswith("(running 9171, this document 9200)")


def test_a_command_whose_reader_goes_away_exits_quietly():
    """`specpool status | head -1`: the pipe closes while the command still prints (here a stand-in command that
    prints 1 MB); it used to end in a BrokenPipeError traceback."""
    process = subprocess.Popen([sys.executable, "-c", "import sys; from router import cli; "
                                "cli.run_admin = lambda args: print('x' * 1000000) or 0; sys.exit(cli.main(['status']))"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.read(1)
    process.stdout.close()
    _, err = process.communicate(timeout=60)
    assert err.decode() == "" and process.returncode == 141
