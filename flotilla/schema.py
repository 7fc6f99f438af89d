"""``OutputSchema``: the shape ``parse`` asks the model for, and the check of what came back.

A schema comes from a pydantic model class or from a JSON-schema dict. The
SDK never imports pydantic: a class counts as a model when it has
``model_json_schema()`` and ``model_validate_json()`` (``SchemaModel``), and
its own validation runs. A dict is checked with ``jsonschema``, imported
only then; without it the schema is refused up front with
``MissingDependencyError`` rather than the reply going unchecked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, overload

from flotilla.errors import ConfigError, MissingDependencyError, StructuredOutputError
from flotilla.params import JsonSchema, ResponseFormat

if TYPE_CHECKING:
    from typing_extensions import Self

T = TypeVar("T")
MAX_NAME_CHARS = 64  # OpenAI's limit on json_schema.name (and function names)
_NOT_IN_NAME = re.compile(r"[^a-zA-Z0-9_-]")


class SchemaModel(Protocol):
    """What ``parse`` needs of a model class: pydantic v2's ``BaseModel`` has both."""

    @classmethod
    def model_json_schema(cls) -> dict[str, Any]: ...

    @classmethod
    def model_validate_json(cls, json_data: str) -> Self: ...


M = TypeVar("M", bound=SchemaModel)
SchemaSpec = type[SchemaModel] | Mapping[str, Any]  # what parse(response_format=...) takes


def is_model_class(spec: object) -> bool:
    """True for a class with ``model_json_schema`` and ``model_validate_json`` (a pydantic model)."""
    return (isinstance(spec, type) and callable(getattr(spec, "model_json_schema", None))
            and callable(getattr(spec, "model_validate_json", None)))


def schema_name(name: str) -> str:
    """``name`` made a valid ``json_schema.name``: letters, digits, ``_`` and ``-``, at most 64."""
    return _NOT_IN_NAME.sub("_", name)[:MAX_NAME_CHARS] or "response"


class OutputSchema(Generic[T]):
    """A named JSON schema and the check that turns a reply's text into a ``T``.

    Build it with :meth:`of`; the check raises ``StructuredOutputError`` for
    text that is not JSON or does not match.
    """

    def __init__(self, name: str, schema: JsonSchema, check: Callable[[str], T]) -> None:
        self.name = name
        self.schema = schema
        self._check = check

    @overload
    @staticmethod
    def of(spec: type[M], *, name: str | None = None) -> OutputSchema[M]: ...

    @overload
    @staticmethod
    def of(spec: Mapping[str, Any], *, name: str | None = None) -> OutputSchema[Any]: ...

    @staticmethod
    def of(spec: SchemaSpec, *, name: str | None = None) -> OutputSchema[Any]:
        """The schema of a model class (named after the class) or of a JSON-schema dict (its ``title``)."""
        if is_model_class(spec):
            model: Any = spec  # checked by is_model_class; mypy cannot narrow a Protocol's type
            return OutputSchema(schema_name(name or model.__name__), model.model_json_schema(),
                                model.model_validate_json)
        if isinstance(spec, Mapping):
            schema = dict(spec)
            return OutputSchema(schema_name(name or str(schema.get("title") or "response")), schema,
                                json_schema_check(schema))
        raise ConfigError("must be a model class with model_json_schema() and model_validate_json() "
                          f"(a pydantic model) or a JSON-schema dict, got {spec!r}", param="response_format")

    def response_format(self) -> ResponseFormat:
        """``{"type": "json_schema", "json_schema": {"name", "schema", "strict": true}}``."""
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.schema, "strict": True}}

    def validate(self, text: str, *, finish_reason: str | None = None, what: str = "the reply") -> T:
        """``text`` checked and converted; ``StructuredOutputError`` (text, finish_reason) if it fails."""
        try:
            return self._check(text)
        except ValueError as exc:  # json.JSONDecodeError, pydantic's ValidationError, json_schema_check
            cut = " (finish_reason 'length': max_tokens cut the output short)" if finish_reason == "length" else ""
            raise StructuredOutputError(f"{what} does not match schema {self.name!r}{cut}: {exc}", text=text,
                                        finish_reason=finish_reason) from exc


def json_schema_check(schema: JsonSchema) -> Callable[[str], Any]:
    """A check that loads JSON text and validates it against ``schema`` with ``jsonschema``.

    Raises ``MissingDependencyError`` when ``jsonschema`` is not installed and
    ``ConfigError`` when ``schema`` itself is invalid, both before any request.
    """
    try:
        # Here, not at the top: jsonschema is optional, and only dict schemas need it.
        import jsonschema
    except ImportError:
        raise MissingDependencyError(
            "checking a reply against a JSON-schema dict needs the jsonschema package "
            "(pip install jsonschema); or pass a pydantic model class instead", package="jsonschema") from None
    validator_cls = jsonschema.validators.validator_for(schema)
    try:
        validator_cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ConfigError(f"is not a valid JSON schema: {exc.message}", param="response_format") from None
    validator = validator_cls(schema)

    def check(text: str) -> Any:
        value = json.loads(text)
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "the top level"
            raise ValueError(f"at {where}: {error.message}")
        return value

    return check
