"""The config file says what the operator meant or is refused in one line naming the place: a key given twice
(PyYAML keeps the last silently: `k: 2 ... k: 6` gave 6, a second `speculation:` block replaced the first), a
section with no value (it reset the whole section to its defaults), a section that is no mapping (the message had
a stray dot, `speculation.:`), bad YAML (several lines pointing at `in "<unicode string>"`) and a misspelt key (a
list of every key, with no hint which one was meant)."""
import re
import textwrap

import pytest
import yaml

from settings.schema import ConfigError, config_from_dict, load_config, read_yaml
from settings.yaml_doc import parse_yaml


def written(tmp_path, text: str):
    path = tmp_path / "specpool.yaml"
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def refusal(path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path):
    path = written(tmp_path, """
        speculation:
          k: 2
          policy: fixed
          k: 6
        """)
    assert refusal(path) == f"{path}, line 4: duplicate key speculation.k (first on line 2); give each key once"


def test_a_section_given_twice_is_refused(tmp_path):
    path = written(tmp_path, """
        speculation:
          k: 2
        router:
          port: 50051
        speculation:
          policy: fixed
        """)
    assert refusal(path) == f"{path}, line 5: duplicate key speculation (first on line 1); give each key once"


def test_the_same_key_in_different_sections_and_merge_keys_are_no_duplicates():
    data = parse_yaml("base: &base {k: 2}\nspeculation:\n  <<: *base\n  k: 3\nrouter: {port: 1}\nhttp: {port: 2}\n",
                      "x.yaml")
    assert data["speculation"] == {"k": 3} and data["router"]["port"] == 1


def test_a_section_with_no_value_is_refused_not_read_as_its_defaults(tmp_path):
    path = written(tmp_path, """
        speculation:
        router:
          port: 50051
        """)
    assert refusal(path) == "speculation: empty; leave the section out for its defaults"


@pytest.mark.parametrize("value", [5, 0, "''", "[]"])
def test_a_section_that_is_no_mapping_is_refused_naming_the_section(tmp_path, value):
    path = written(tmp_path, f"speculation: {value}\n")
    assert re.fullmatch(r"speculation: must be a mapping \(got .*\)", refusal(path))


def test_bad_yaml_is_one_line_naming_the_file_and_line(tmp_path):
    path = written(tmp_path, """
        speculation:
          k: 2
         policy: fixed
        """)
    message = refusal(path)
    assert message.startswith(f"{path}, line 3: invalid YAML: "), message
    assert "<unicode string>" not in message
    with pytest.raises(ConfigError, match=r"^config_yaml, line 2: invalid YAML: [^\n]*$"):
        parse_yaml("a: [1, 2\n", "config_yaml")
    with pytest.raises(ConfigError, match=r"^config_yaml, line 2: invalid YAML: unacceptable character #x0007 "):
        parse_yaml("a: 1\nb: \x07\n", "config_yaml")


def test_a_misspelt_key_is_refused_with_the_closest_known_one_before_the_list():
    with pytest.raises(ConfigError, match=r"^speculation\.overlap_token: unknown key, did you mean "
                                          r"'overlap_tokens'\? \(known: adjust_every, .*\)$"):
        config_from_dict({"speculation": {"overlap_token": 4}})
    with pytest.raises(ConfigError, match=r"^specualtion: unknown key, did you mean 'speculation'\? \(known: "):
        config_from_dict({"specualtion": {}})
    with pytest.raises(ConfigError, match=r"^speculation\.zzz: unknown key \(known: "):
        config_from_dict({"speculation": {"zzz": 4}})


def test_a_valid_file_reads_as_before(tmp_path):
    path = written(tmp_path, """
        speculation:
          k: 2
          policy: fixed
        draft: {model: gpt2}
        target: {model: gpt2}
        """)
    assert read_yaml(path) == {"speculation": {"k": 2, "policy": "fixed"}, "draft": {"model": "gpt2"},
                               "target": {"model": "gpt2"}}
    assert load_config(path).speculation.k == 2


def test_the_config_an_admin_client_sees_shows_no_bearer_key():
    """Admin.GetStatus sends the running config as YAML (config_to_yaml): http.api_keys comes as <redacted>, and
    everything else as it is."""
    import dataclasses

    from settings.schema import SpecpoolConfig, config_to_yaml

    plain = SpecpoolConfig()
    keyed = dataclasses.replace(plain, http=dataclasses.replace(plain.http, api_keys=["sk-secret"]))
    shown = yaml.safe_load(config_to_yaml(keyed))
    assert "sk-secret" not in config_to_yaml(keyed) and shown["http"]["api_keys"] == "<redacted>"
    assert yaml.safe_load(config_to_yaml(plain)) == dataclasses.asdict(plain)


@pytest.mark.parametrize("section, key", [("http", "api_keys"), ("router", "admin_keys")])
@pytest.mark.parametrize("value", ["sk-secret", {"key": "sk-secret"}, ["sk-secret", ""]],
                         ids=["scalar", "mapping", "an empty key"])
def test_a_bearer_key_of_the_wrong_shape_is_refused_without_showing_it(section, key, value):
    """A key written as a scalar (`admin_keys: sk-secret`) or a mapping is refused by the type check, which showed
    the value (`must be list (got 'sk-secret')`) in serve's log and the reload's answer; now it says <redacted>."""
    with pytest.raises(ConfigError) as info:
        config_from_dict({section: {key: value}})
    assert str(info.value).startswith(f"{section}.{key}: must be ") and "sk-secret" not in str(info.value)
    assert "<redacted>" in str(info.value)
