"""Config YAML parsed strictly: a key given twice in one mapping is refused (PyYAML keeps the last one silently,
so `k: 2 ... k: 6` gave 6 and a second `speculation:` block replaced the first), and every YAML error is one line
naming the file and line (PyYAML's own spans several lines pointing at `in "<unicode string>"`)."""
from __future__ import annotations

import yaml

from settings.errors import ConfigError

_MERGE_TAG = "tag:yaml.org,2002:merge"     # `<<: *base`: keys merged in may be overridden, so never duplicates


def parse_yaml(text: str, source: str):
    """The document in `text` as Python data (None if empty), read as yaml.safe_load reads it; ConfigError on bad
    YAML or a duplicate key, naming `source` (a file name, or e.g. "config_yaml") and the line."""
    try:
        loader = yaml.SafeLoader(text)       # refuses a non-printable character here
        try:
            node = loader.get_single_node()
            if node is not None:
                _check_keys(node, "", source, set())
            return None if node is None else loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise ConfigError(_one_line(exc, source, text)) from None


def _check_keys(node: yaml.Node, prefix: str, source: str, seen: set) -> None:
    """Refuse the first key that appears twice in one mapping of the tree under `node`, naming it dotted."""
    if id(node) in seen:             # an alias: checked where its anchor is (and a recursive one ends here)
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_keys(item, f"{prefix}{index}.", source, seen)
    elif isinstance(node, yaml.MappingNode):
        lines: dict = {}
        for key, value in node.value:
            if key.tag == _MERGE_TAG or not isinstance(key, yaml.ScalarNode):
                continue
            name = key.value
            if (key.tag, name) in lines:
                raise ConfigError(f"{source}, line {key.start_mark.line + 1}: duplicate key {prefix}{name} "
                                  f"(first on line {lines[key.tag, name]}); give each key once")
            lines[key.tag, name] = key.start_mark.line + 1
            _check_keys(value, f"{prefix}{name}.", source, seen)


def _one_line(exc: yaml.YAMLError, source: str, text: str) -> str:
    """PyYAML's error as one line: `source, line N: invalid YAML: problem (context, line M)`."""
    if isinstance(exc, yaml.reader.ReaderError):
        line = text[:exc.position].count("\n") + 1
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        return f"{source}, line {line}: invalid YAML: unacceptable character #x{code:04x} ({exc.reason})"
    mark = getattr(exc, "problem_mark", None)
    if mark is None:
        return f"{source}: invalid YAML: {' '.join(str(exc).split())}"
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    where = f" ({context}, line {context_mark.line + 1})" if context and context_mark else ""
    return f"{source}, line {mark.line + 1}: invalid YAML: {exc.problem}{where}"
