from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ReloadRequest(_message.Message):
    __slots__ = ("config_yaml", "config_dir")
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    CONFIG_DIR_FIELD_NUMBER: _ClassVar[int]
    config_yaml: str
    config_dir: str
    def __init__(self, config_yaml: _Optional[str] = ..., config_dir: _Optional[str] = ...) -> None: ...

class ReloadResponse(_message.Message):
    __slots__ = ("speculation_yaml", "changes")
    SPECULATION_YAML_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    speculation_yaml: str
    changes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, speculation_yaml: _Optional[str] = ..., changes: _Optional[_Iterable[str]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("config_yaml", "stats_json")
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    config_yaml: str
    stats_json: str
    def __init__(self, config_yaml: _Optional[str] = ..., stats_json: _Optional[str] = ...) -> None: ...
