"""`parse_tf_example`: `tf.train.Example` records (the usual payload of TFRecord and
ArrayRecord files written by TensorFlow jobs) parsed into columns without TensorFlow: the
message classes are made from their descriptor with protobuf alone, in a descriptor pool of
their own (so they never clash with TensorFlow's when both are loaded)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from colo_data.errors import SourceError

_KINDS = {"bytes_list": None, "float_list": np.float32, "int64_list": np.int64}


@cache
def example_class() -> Any:
    """The `tensorflow.Example` message class (example.proto and feature.proto, as published)."""
    f = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="colo_data/tf_example.proto", package="tensorflow", syntax="proto3")

    def message(name: str, *fields: tuple[str, int, int, int, str], parent: Any = None) -> Any:
        kind = (parent.nested_type if parent is not None else proto.message_type).add(name=name)
        for field_name, number, label, type_, type_name in fields:
            field = kind.field.add(name=field_name, number=number, label=label, type=type_)
            if type_name:
                field.type_name = type_name
        return kind

    repeated, optional = f.LABEL_REPEATED, f.LABEL_OPTIONAL
    message("BytesList", ("value", 1, repeated, f.TYPE_BYTES, ""))
    message("FloatList", ("value", 1, repeated, f.TYPE_FLOAT, ""))
    message("Int64List", ("value", 1, repeated, f.TYPE_INT64, ""))
    feature = message(
        "Feature",
        ("bytes_list", 1, optional, f.TYPE_MESSAGE, ".tensorflow.BytesList"),
        ("float_list", 2, optional, f.TYPE_MESSAGE, ".tensorflow.FloatList"),
        ("int64_list", 3, optional, f.TYPE_MESSAGE, ".tensorflow.Int64List"),
    )
    feature.oneof_decl.add(name="kind")
    for field in feature.field:
        field.oneof_index = 0
    features = message("Features", ("feature", 1, repeated, f.TYPE_MESSAGE, ".tensorflow.Features.FeatureEntry"))
    entry = message(
        "FeatureEntry",
        ("key", 1, optional, f.TYPE_STRING, ""),
        ("value", 2, optional, f.TYPE_MESSAGE, ".tensorflow.Feature"),
        parent=features,
    )
    entry.options.map_entry = True
    message("Example", ("features", 1, optional, f.TYPE_MESSAGE, ".tensorflow.Features"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


def parse_tf_example(records: Sequence[bytes]) -> dict[str, Any]:
    """Columns of serialized `tf.train.Example`s: one per feature (in name order), one entry a record. A
    feature with one value in every record is a scalar column (int64, float32, or bytes);
    any other is a list column (a numpy array a record). A feature a record lacks is None
    there. For `cd.sources.ArrayRecordSource(paths, parse=cd.sources.parse_tf_example)`.

    Raises:
        SourceError: a record that is not an Example, or a feature of two kinds (named).
    """
    example = example_class()
    found: dict[str, tuple[str, list[Any]]] = {}
    for i, record in enumerate(records):
        try:
            parsed = example.FromString(record)
        except Exception as e:  # protobuf's DecodeError; its type depends on the backend
            raise SourceError(f"record {i} of the chunk is not a tf.train.Example ({e})") from e
        for name, feature in parsed.features.feature.items():
            kind = feature.WhichOneof("kind")
            if kind is None:
                continue
            seen = found.setdefault(name, (kind, [None] * len(records)))
            if seen[0] != kind:
                raise SourceError(
                    f"feature {name!r} is a {seen[0]} in some records and a {kind} in record {i} of the chunk: give "
                    "each feature one kind"
                )
            seen[1][i] = getattr(feature, kind).value
    return {name: _column(*found[name]) for name in sorted(found)}


def _column(kind: str, values: list[Any]) -> Any:
    dtype = _KINDS[kind]
    if all(v is not None and len(v) == 1 for v in values):
        return [v[0] for v in values] if dtype is None else np.array([v[0] for v in values], dtype)
    if dtype is None:
        return [None if v is None else list(v) for v in values]
    return [None if v is None else np.array(v, dtype) for v in values]
