"""From a request body to a checked JobSpec: the schema first, then the rules that span
several fields or need the performance model."""

from __future__ import annotations

import math
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
#: a job spec is two levels deep (labels, command); far deeper YAML is refused
MAX_YAML_DEPTH = 16

_json_decoder = msgspec.json.Decoder(JobSpec)


def accepts(content_type: str) -> bool:
    return content_type in JSON_TYPES or content_type in YAML_TYPES


def decode_spec(body: bytes, content_type: str) -> JobSpec:
    """A JobSpec from a JSON or YAML body; a problem naming the bad field otherwise."""
    if not body.strip():
        raise ProblemError(400, "empty-body", "the request body is empty; send a job spec")
    if content_type in YAML_TYPES:
        return _from_yaml(body)
    try:
        return _json_decoder.decode(body)
    except msgspec.ValidationError as exc:
        # JSON Schema takes 4.0 for an integer; decode again, reading such numbers as ints
        try:
            document = msgspec.json.decode(body)
        except msgspec.MsgspecError:
            raise _invalid(exc) from None
        return _convert(document)
    except msgspec.DecodeError as exc:
        raise ProblemError(400, "malformed-body", f"the body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ProblemError(
            400, "malformed-body", f"the body is not valid UTF-8 (byte {exc.start})"
        ) from None


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
        if self._depth >= MAX_YAML_DEPTH:
            raise ComposerError(
                None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
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
