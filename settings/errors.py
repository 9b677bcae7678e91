"""The config's one error type, apart so that the YAML reader (yaml_doc) and the schema (schema) both raise it."""


class ConfigError(ValueError):
    """A config value is missing, unknown or out of range, or the document is no valid YAML; the message names
    the key (or the file and line)."""
