"""`cd.sources`: where records come from. `ArrowSource` (Parquet and Arrow files, also
`cd.ArrowSource`) and its dataset index, ArrayRecord files, any random-access source
(`RecordSource`, the `Source` protocol), and the column types a transform receives."""

from colo_data.io.array_record import ArrayRecordSource, parse_json
from colo_data.io.arrow_source import ArrowSource
from colo_data.io.columns import Column, Columns
from colo_data.io.dataset_index import write_index
from colo_data.io.record_source import RecordSource, Source
from colo_data.io.tf_example import parse_tf_example

__all__ = [
    "ArrayRecordSource",
    "ArrowSource",
    "Column",
    "Columns",
    "RecordSource",
    "Source",
    "parse_json",
    "parse_tf_example",
    "write_index",
]
