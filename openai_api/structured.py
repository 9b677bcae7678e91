"""Structured output over HTTP: OpenAI's `response_format`, vLLM's `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar` and `structured_outputs`, and SGLang's `json_schema`, `regex` and `ebnf`, each as the
GenerateRequest.structured_output the router compiles (router/structured_output.py). At most one per request.

    {"response_format": {"type": "json_schema", "json_schema": {"name": "point", "schema": {"type": "object"}}}}
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protos.specpool.v1 import generation_pb2

JsonSchema = Union[dict[str, Any], bool]


class SchemaSpec(BaseModel):
    """response_format.json_schema: OpenAI's name, description, schema and strict (specpool's output always
    follows the schema, strict or not)."""
    name: str = Field(strict=True)
    description: Optional[str] = None
    schema_: Optional[JsonSchema] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (free), json_object (any JSON object) or json_schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[SchemaSpec] = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("`json_schema` is required when `type` is \"json_schema\"")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs object: one of its keys."""
    model_config = ConfigDict(extra="forbid")
    json_: Optional[Union[JsonSchema, str]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = Field(None, min_length=1)
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


# The parameters, in the order a body's is looked for; each value -> its StructuredOutput fields
PARAMETERS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
              "guided_grammar", "json_schema", "regex", "ebnf")


def schema_text(schema: Any) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


def _fields(param: str, value: Any) -> dict | None:
    """The StructuredOutput fields `value` of `param` asks for (None: free text)."""
    if param == "response_format":
        if value.type == "text":
            return None
        if value.type == "json_object":
            return {"json_object": True}
        return {"json_schema": schema_text(True if value.json_schema.schema_ is None else value.json_schema.schema_)}
    if param == "structured_outputs":
        asked = {key: getattr(value, attr) for key, attr in (("json_schema", "json_"), ("regex", "regex"),
                 ("choice", "choice"), ("grammar", "grammar"), ("json_object", "json_object"))
                 if getattr(value, attr) is not None}
        if "json_schema" in asked:
            asked["json_schema"] = schema_text(asked["json_schema"])
        return asked or None
    key = {"guided_json": "json_schema", "json_schema": "json_schema", "guided_regex": "regex", "regex": "regex",
           "guided_choice": "choice", "guided_grammar": "grammar", "ebnf": "grammar"}[param]
    return {key: schema_text(value) if key == "json_schema" else value}


def structured_output(body) -> tuple[str, generation_pb2.StructuredOutput] | None:
    """(the parameter, the StructuredOutput) a body asks for, or None; ValueError naming the parameter if it asks
    for two, or for two kinds in one structured_outputs."""
    asked = [(param, fields) for param in PARAMETERS if getattr(body, param, None) is not None
             for fields in [_fields(param, getattr(body, param))] if fields]
    if len(asked) > 1:
        raise ValueError(asked[1][0], f"one structured output per request (`{asked[0][0]}` asks for one too)")
    if not asked:
        return None
    param, fields = asked[0]
    if len(fields) > 1:
        raise ValueError(param, f"one of {', '.join(sorted(fields))}, not several")
    (key, value), = fields.items()
    if key == "choice":
        return param, generation_pb2.StructuredOutput(choice=generation_pb2.Choices(options=value))
    return param, generation_pb2.StructuredOutput(**{key: value})
