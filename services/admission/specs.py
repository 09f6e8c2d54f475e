"""From a request body to a checked JobSpec: the schema first, then the rules that span
several fields or need the performance model."""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from decimal import Decimal
from typing import Any

import msgspec
import yaml
from yaml.composer import ComposerError

from gpusched.libs.common.schemas import MAX_ITERATIONS, JobSpec
from gpusched.services.admission.problems import ProblemError, field_of, message_of

JSON_TYPES = frozenset({"application/json"})
YAML_TYPES = frozenset({"application/yaml", "application/x-yaml", "text/yaml"})
ACCEPTED_TYPES = tuple(sorted(JSON_TYPES | YAML_TYPES))
#: a job spec is two levels deep (labels, command); a far deeper body is refused
MAX_DEPTH = 16

#: what a name, a model, a label's key and value may not hold: control characters
#: (C0, DEL and C1: terminal escapes, NUL, line breaks), as a JSON Schema pattern that
#: reads the same to Python's ``re`` (the OpenAPI document publishes it)
TEXT_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*$"
#: what an argument of ``command`` may not hold: NUL, which no process can be given (a
#: tab or a line break in an argument is the job's business)
ARGUMENT_PATTERN = r"^[^\x00]*$"
_TEXT = re.compile(TEXT_PATTERN)
_ARGUMENT = re.compile(ARGUMENT_PATTERN)

_json_decoder = msgspec.json.Decoder(JobSpec)


def accepts(content_type: str) -> bool:
    return content_type in JSON_TYPES or content_type in YAML_TYPES


def decode_spec(body: bytes, content_type: str) -> JobSpec:
    """A JobSpec from a JSON or YAML body; a problem naming the bad field otherwise."""
    if not body.strip():
        raise ProblemError(400, "empty-body", "the request body is empty; send a job spec")
    spec = _from_yaml(body) if content_type in YAML_TYPES else _from_json(body)
    check_text(spec)
    return spec


def _from_json(body: bytes) -> JobSpec:
    try:
        return _json_decoder.decode(body)
    except msgspec.ValidationError as exc:
        # JSON Schema takes 4.0 for an integer; decode again, reading such numbers as ints.
        # Untyped, that decode recurses once per level: a deep body is refused first
        if json_depth(body) > MAX_DEPTH:
            raise _too_deep() from None
        try:
            document = msgspec.json.decode(body)
        except msgspec.MsgspecError:
            raise _invalid(exc) from None
        except RecursionError:
            raise _too_deep() from None
        return _convert(document)
    except msgspec.DecodeError as exc:
        raise ProblemError(400, "malformed-body", f"the body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ProblemError(
            400, "malformed-body", f"the body is not valid UTF-8 (byte {exc.start})"
        ) from None


def json_depth(body: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings
    do not count); the text need not be valid JSON."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in body:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return deepest


def _too_deep() -> ProblemError:
    return ProblemError(
        400, "malformed-body",
        f"the body is nested deeper than {MAX_DEPTH} levels; a job spec is two levels deep",
    )


def check_text(spec: JobSpec) -> None:
    """Names, the model and labels hold no control characters (a terminal would run
    them as escapes where they are shown), and no argument of ``command`` holds NUL (a
    process cannot be started with it): a 422 naming the field otherwise."""
    for name in ("name", "model"):
        value = getattr(spec, name)
        if not _TEXT.fullmatch(value):
            raise _control(name, value, "control characters")
    for key, value in spec.labels.items():
        for text in (key, value):
            if not _TEXT.fullmatch(text):
                raise _control("labels", text, "control characters", f" (label {key!r})")
    for index, argument in enumerate(spec.command or ()):
        if not _ARGUMENT.fullmatch(argument):
            raise _control(f"command[{index}]", argument, "a NUL byte")


def _control(field: str, value: str, what: str, where: str = "") -> ProblemError:
    return ProblemError(
        422, "invalid-field", f"{field}: must not hold {what}{where}, got {value[:64]!r}",
        field=field,
    )


def _from_yaml(body: bytes) -> JobSpec:
    try:
        document: Any = yaml.load(body, Loader=_NoAliasLoader)
    except yaml.YAMLError as exc:
        raise ProblemError(
            400, "malformed-body", f"the body is not valid YAML: {_one_line(exc)}"
        ) from None
    return _convert(document)


def _integer_fields() -> frozenset[str]:
    info = msgspec.inspect.type_info(JobSpec)
    assert isinstance(info, msgspec.inspect.StructType)
    names = set()
    for field in info.fields:
        kinds = field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else (
            field.type,
        )
        if any(isinstance(kind, msgspec.inspect.IntType) for kind in kinds):
            names.add(field.encode_name)
    return frozenset(names)


#: fields whose number may be written as a whole float (``4.0``), as JSON Schema allows
INTEGER_FIELDS = _integer_fields()


def _convert(document: Any) -> JobSpec:
    if isinstance(document, dict):
        for name in INTEGER_FIELDS & document.keys():
            value = document[name]
            if isinstance(value, float) and value.is_integer():
                document[name] = int(value)
    try:
        return msgspec.convert(document, JobSpec)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from None


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader without aliases and deep nesting: a job spec needs neither, aliases let
    a small body expand into a huge document, and nesting recurses once per level."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ComposerError(
                None, None, "aliases are not allowed in a job spec", event.start_mark
            )
        if self._depth >= MAX_DEPTH:
            raise ComposerError(
                None, None, f"nested deeper than {MAX_DEPTH} levels",
                self.peek_event().start_mark,
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _invalid(exc: msgspec.ValidationError) -> ProblemError:
    field = field_of(exc)
    where = f"{field}: " if field else ""
    return ProblemError(422, "invalid-field", f"{where}{message_of(exc)}", field=field)


def total_iterations(spec: JobSpec, known_models: Collection[str]) -> int:
    """Checks the rules the schema cannot express and returns how many iterations the
    job runs: ``iterations`` as given, or ceil(epochs * dataset_size / batch_size)."""
    if spec.model not in known_models:
        names = sorted(known_models)
        raise ProblemError(
            422,
            "unknown-model",
            f"model: unknown model {spec.model!r}; known models: {', '.join(names)}",
            field="model",
            allowed=names,
        )
    if spec.min_batch_size is not None and spec.min_batch_size > spec.batch_size:
        raise ProblemError(
            422,
            "invalid-field",
            f"min_batch_size: {spec.min_batch_size} is above batch_size {spec.batch_size}",
            field="min_batch_size",
        )
    if spec.max_batch_size is not None and spec.max_batch_size < spec.batch_size:
        raise ProblemError(
            422,
            "invalid-field",
            f"max_batch_size: {spec.max_batch_size} is below batch_size {spec.batch_size}",
            field="max_batch_size",
        )
    _check_parallelism(spec)
    return _iterations(spec)


def _check_parallelism(spec: JobSpec) -> None:
    model_parallel = spec.tensor_parallel * spec.pipeline_parallel
    if spec.data_parallel is not None:
        if model_parallel * spec.data_parallel != spec.gpus:
            raise ProblemError(
                422,
                "invalid-field",
                f"data_parallel: tensor_parallel {spec.tensor_parallel} x pipeline_parallel "
                f"{spec.pipeline_parallel} x data_parallel {spec.data_parallel} = "
                f"{model_parallel * spec.data_parallel}, but the job asks for {spec.gpus} GPUs",
                field="data_parallel",
            )
        return
    if spec.gpus % model_parallel:
        field = "tensor_parallel" if spec.gpus % spec.tensor_parallel else "pipeline_parallel"
        raise ProblemError(
            422,
            "invalid-field",
            f"{field}: tensor_parallel {spec.tensor_parallel} x pipeline_parallel "
            f"{spec.pipeline_parallel} = {model_parallel} does not divide {spec.gpus} GPUs",
            field=field,
        )


def _iterations(spec: JobSpec) -> int:
    if spec.iterations is not None and spec.epochs is not None:
        raise ProblemError(
            422,
            "invalid-field",
            "epochs: give either iterations or epochs, not both",
            field="epochs",
        )
    if spec.iterations is not None:
        return spec.iterations
    if spec.epochs is None:
        raise ProblemError(
            422,
            "invalid-field",
            "iterations: say how long the job runs with iterations, or with epochs and "
            "dataset_size",
            field="iterations",
        )
    if spec.dataset_size is None:
        raise ProblemError(
            422,
            "invalid-field",
            "dataset_size: epochs needs dataset_size (samples per epoch)",
            field="dataset_size",
        )
    # the decimal the user wrote, not its binary neighbour: 0.1 epochs of 30 samples at
    # batch 3 is 1 iteration, where float arithmetic would round up to 2
    exact = Decimal(repr(spec.epochs)) * spec.dataset_size / spec.batch_size
    iterations = max(1, math.ceil(exact))
    if iterations > MAX_ITERATIONS:
        raise ProblemError(
            422,
            "invalid-field",
            f"epochs: {spec.epochs} epochs of {spec.dataset_size} samples at batch "
            f"{spec.batch_size} is {iterations} iterations, above {MAX_ITERATIONS}",
            field="epochs",
        )
    return iterations


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
