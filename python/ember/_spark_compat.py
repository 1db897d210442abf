"""What differs between the Spark versions Ember runs on: 3.5 (Scala 2.12)
and 4.x (Scala 2.13).  Every switch on pyspark's version is here, so the rest
of Ember calls one function whatever the version.  The Spark jar's
differences are in spark/src (``Plans``) and ember._jars."""

from __future__ import annotations

from typing import Any, Tuple

from ember.errors import SparkVersionError

#: The oldest Spark Ember runs on (pyproject.toml's extras say the same).
OLDEST = (3, 5)
#: The Spark that brought ``pyspark.sql.functions.arrow_udf`` (EmberModel's ArrowPath 'udf').
ARROW_UDF = (4, 1)
#: The Spark that brought mapInArrow's ``profile`` (stage-level resources over Spark Connect).
MAP_IN_ARROW_PROFILE = (4, 0)
#: The Spark whose ML persistence takes a SparkSession (so runs over Spark Connect).
ML_SESSION = (4, 0)


def version() -> Tuple[int, int]:
    """pyspark's (major, minor) version."""
    import pyspark

    major, minor = pyspark.__version__.split(".")[:2]
    return int(major), int(minor)


def has(needed: Tuple[int, int]) -> bool:
    """Whether pyspark is ``needed`` or later (one of the versions above)."""
    return version() >= needed


def require(feature: str, needed: Tuple[int, int]) -> None:
    """Raises :class:`SparkVersionError` naming ``feature`` and the Spark
    version it needs when pyspark is older than ``needed``."""
    if not has(needed):
        import pyspark

        raise SparkVersionError(f"{feature} needs Spark {needed[0]}.{needed[1]} or later; "
                                f"this is pyspark {pyspark.__version__}")


def to_arrow(df: Any) -> Any:
    """A DataFrame's rows collected to the driver as one ``pyarrow.Table``:
    ``DataFrame.toArrow`` from Spark 4.0 on; before, the private call that
    ``toPandas`` makes, whose empty result has no schema of its own."""
    if hasattr(df, "toArrow"):
        return df.toArrow()
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema

    batches = df._collect_as_arrow()
    return pa.Table.from_batches(batches) if batches else \
        to_arrow_schema(df.schema).empty_table()


def ml_context(session: Any) -> Any:
    """What ``DefaultParamsWriter.saveMetadata`` and
    ``DefaultParamsReader.loadMetadata`` take: the session from Spark 4.0 on
    (the only choice over Spark Connect), its SparkContext before."""
    return session if has(ML_SESSION) else session.sparkContext
