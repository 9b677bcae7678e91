"""Every count in the speculation and draft sections that sizes a round's work has an upper bound, refused at
load (and so at reload) naming the key and the allowed range. `speculation.k_max: 100000` used to be accepted by a
reload; a 32-token request then took 3m52s and `specpool status` pinned the router's event loop for minutes (the
controller's cost model is quadratic in k_max)."""
import re

import pytest

from settings.schema import ConfigError, config_from_dict

TOO_LARGE = [
    ("speculation", "k_max", 65, "must be in [k_min, 64] = [0, 64]"),
    ("speculation", "overlap_tokens", 66, "must be 0 or in [2, 65]"),
    ("speculation", "overlap_branches", 129, "must be in [0, 128]"),
    ("speculation", "decode_steps", 1025, "must be in [1, 1024]"),
    ("speculation", "window", 65537, "must be in [1, 65536]"),
    ("speculation", "min_samples", 65537, "must be in [0, 65536]"),
    ("speculation", "change_recent", 1025, "must be in [1, 1024]"),
    ("draft", "ngram_max_tokens", 65, "must be in [1, 64]"),
    ("draft", "ngram_max", 33, "must be in [ngram_min, 32] = [2, 32]"),
    ("draft", "prediction_trial_rounds", 1025, "must be in [0, 1024]"),
    ("http", "store_responses", 1_000_001, "must be in [0, 1000000]"),       # responses kept in memory
    ("http", "store_responses_mb", 1_000_001, "must be in [1, 1000000]"),
]


@pytest.mark.parametrize("section, key, value, rule", TOO_LARGE)
def test_a_count_past_its_bound_is_refused_naming_the_key_and_range(section, key, value, rule):
    with pytest.raises(ConfigError, match="^" + re.escape(f"{section}.{key}: {rule} (got {value * 1000})")):
        config_from_dict({section: {key: value * 1000}})
    with pytest.raises(ConfigError, match="^" + re.escape(f"{section}.{key}: {rule} (got {value})") + "$"):
        config_from_dict({section: {key: value}})


@pytest.mark.parametrize("section, key, value, rule", TOO_LARGE)
def test_each_bound_itself_is_accepted(section, key, value, rule):
    config = config_from_dict({section: {key: value - 1, **({"k": 4} if key == "k_max" else {})}})
    assert getattr(getattr(config, section), key) == value - 1

