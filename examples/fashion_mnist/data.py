"""Fashion-MNIST data: idx parsing and Spark data set-up (CSV and TFRecords).

This module does not import TensorFlow: ``to_tfrecords`` writes the Examples
with Ember's C codec (ember.tfrecord), so the data set-up needs no TensorFlow.

Record layout used everywhere in the example:
    image: float32[784], pixels scaled to [0, 1]
    label: int64 in 0..9
"""

import gzip
import os

import numpy as np

NUM_PIXELS = 28 * 28
NUM_CLASSES = 10

DEFAULT_DIR = os.environ.get("EMBER_FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")

_SPLIT_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}

# idx type codes -> big-endian numpy dtype
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class IdxFormatError(ValueError):
    """The file is not a well-formed idx file."""


def read_idx(path):
    """Read an idx file (gzip-compressed if the name ends in .gz).

    Returns a numpy array in native byte order with the shape stored in the
    header.  Raises IdxFormatError when the magic number, the type code, the
    dimension count or the data size do not agree with the header.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise IdxFormatError(f"{path}: cannot read idx file: {e}") from e

    if len(raw) < 4:
        raise IdxFormatError(f"{path}: file too short for an idx header ({len(raw)} bytes)")
    if raw[0] != 0 or raw[1] != 0:
        raise IdxFormatError(
            f"{path}: bad idx magic {raw[:4].hex()} (first two bytes must be zero)"
        )
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise IdxFormatError(f"{path}: unknown idx type code 0x{code:02x}")
    if ndim == 0:
        raise IdxFormatError(f"{path}: idx file declares zero dimensions")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IdxFormatError(
            f"{path}: truncated idx header: need {header} bytes for {ndim} dims, have {len(raw)}"
        )
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[code]
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    actual = len(raw) - header
    if actual != expected:
        raise IdxFormatError(
            f"{path}: idx data size mismatch: header dims {dims} of {dtype.name} need "
            f"{expected} bytes, file has {actual}"
        )
    arr = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    # a writable array in native byte order (frombuffer over bytes is read-only)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def load_split(split, data_dir=None):
    """Load 'train' or 'test': (images uint8 (n, 28, 28), labels uint8 (n,))."""
    if split not in _SPLIT_FILES:
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
    data_dir = data_dir or DEFAULT_DIR
    img_name, lbl_name = _SPLIT_FILES[split]
    images = read_idx(os.path.join(data_dir, img_name))
    labels = read_idx(os.path.join(data_dir, lbl_name))
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
        raise IdxFormatError(
            f"{img_name}: expected uint8 images of shape (n, 28, 28), got "
            f"{images.dtype} {images.shape}"
        )
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise IdxFormatError(
            f"{lbl_name}: expected uint8 labels of shape (n,), got {labels.dtype} {labels.shape}"
        )
    if images.shape[0] != labels.shape[0]:
        raise IdxFormatError(
            f"{split}: {images.shape[0]} images but {labels.shape[0]} labels"
        )
    if labels.size and labels.max() >= NUM_CLASSES:
        raise IdxFormatError(f"{lbl_name}: label {int(labels.max())} out of range 0..9")
    return images, labels


# ---------------------------------------------------------------- record helpers

def to_records(images, labels):
    """(images uint8 (n,28,28), labels) -> list of (float32[784] in [0,1], int label).

    The records to feed an InputMode.SPARK job from an RDD
    (``sc.parallelize(to_records(...))``)."""
    x = np.asarray(images, dtype=np.float32).reshape(-1, NUM_PIXELS) / 255.0
    y = np.asarray(labels).reshape(-1)
    return [(x[i], int(y[i])) for i in range(x.shape[0])]


def parse_csv_line(line):
    """'label,p0,...,p783' (raw pixels 0..255) -> (float32[784] in [0,1], int label)."""
    try:
        values = np.array(line.strip().split(","), dtype=np.float32)
    except ValueError as e:
        raise ValueError(f"bad Fashion-MNIST CSV line {line[:60]!r}...: {e}") from None
    if values.shape[0] != NUM_PIXELS + 1:
        raise ValueError(
            f"bad Fashion-MNIST CSV line: {values.shape[0]} fields, expected {NUM_PIXELS + 1}"
        )
    label = int(values[0])
    if label != values[0] or not 0 <= label < NUM_CLASSES:
        raise ValueError(f"bad Fashion-MNIST CSV line: label {float(values[0])!r} not in 0..9")
    image = values[1:]
    image /= 255.0
    return image, label


#: lines parsed at once by parse_csv_partition (about 9 MB of text)
CSV_CHUNK_LINES = 4096


def parse_csv_lines(lines, scaled=True):
    """Many 'label,p0,...,p783' lines at once (a list of str, or an Arrow
    string array) -> (images float32 (n, 784), in [0,1], or the raw 0..255
    with scaled=False; labels int64 (n,)); the errors parse_csv_line gives,
    for the first bad line.

    Arrow's string kernels split and convert every field in C: 47 us a
    line here, where parse_csv_line (a Python float per field) takes 253
    (3 epochs of the 60,000 lines: about 9 CPU s of the feeding tasks
    instead of 45)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text = lines if isinstance(lines, pa.Array) else pa.array(lines, pa.string())

    def first_bad(mask):  # the per-line parser names what is wrong with it
        line = text[int(np.flatnonzero(mask)[0])].as_py()
        parse_csv_line(line if line is not None else "")
        raise AssertionError("parse_csv_line took a line the chunk parser refused")

    if text.null_count:
        first_bad(text.is_null().to_numpy(zero_copy_only=False))
    fields = pc.split_pattern(pc.utf8_trim_whitespace(text), ",")
    counts = pc.list_value_length(fields).to_numpy(zero_copy_only=False)
    if len(counts) and (counts != NUM_PIXELS + 1).any():
        first_bad(counts != NUM_PIXELS + 1)
    try:
        values = pc.cast(fields.flatten(), pa.float32()).to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        for line in text.to_pylist():  # the slow way, only to name the first line that fails
            parse_csv_line(line)
        raise
    values = values.reshape(len(text), NUM_PIXELS + 1)
    labels = values[:, 0].astype(np.int64)
    bad = (labels != values[:, 0]) | (labels < 0) | (labels >= NUM_CLASSES)
    if bad.any():
        first_bad(bad)
    return (values[:, 1:] / np.float32(255.0) if scaled else values[:, 1:]), labels


def csv_tensors(lines):
    """A DataFrame of CSV lines (its ``value`` column: spark.read.text, or
    readStream) -> image (a tensor column of the 784 raw pixels 0..255 as
    float32) and label (long), parsed in the Python workers by
    parse_csv_lines (ember.tensors.to_arrow and declare: no array column
    is ever built in the JVM)."""
    from ember import tensors

    parsed = lines.select("value").mapInArrow(_parse_csv_batches, "image binary, label long")
    return tensors.declare(parsed, {"image": (np.float32, (NUM_PIXELS,))})


def _parse_csv_batches(batches):
    import pyarrow as pa

    from ember import tensors

    for rb in batches:
        images, labels = parse_csv_lines(rb.column("value"), scaled=False)
        yield pa.RecordBatch.from_arrays([tensors.to_arrow(images), pa.array(labels)],
                                         names=["image", "label"])


def parse_csv_partition(lines):
    """A partition's lines -> (float32[784] in [0,1], int label) records, as
    parse_csv_line gives them, parsed CSV_CHUNK_LINES at a time
    (``rdd.mapPartitions(parse_csv_partition)``)."""
    chunk = []
    for line in lines:
        chunk.append(line)
        if len(chunk) == CSV_CHUNK_LINES:
            yield from _records(*parse_csv_lines(chunk))
            chunk = []
    if chunk:
        yield from _records(*parse_csv_lines(chunk))


def _records(images, labels):
    return zip(images, labels.tolist())


# ---------------------------------------------------------------- Spark data set-up

def _chunks(images, labels, num_partitions):
    """Split the arrays into num_partitions contiguous (first index, images, labels) chunks."""
    images = np.ascontiguousarray(np.asarray(images, dtype=np.uint8).reshape(-1, NUM_PIXELS))
    labels = np.asarray(labels).reshape(-1).astype(np.int64)
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {labels.shape[0]} labels")
    num_partitions = max(1, min(int(num_partitions), images.shape[0] or 1))
    bounds = np.linspace(0, images.shape[0], num_partitions + 1).astype(np.int64)
    return [
        (int(bounds[i]), images[bounds[i]:bounds[i + 1]], labels[bounds[i]:bounds[i + 1]])
        for i in range(num_partitions)
    ]


def _local_path(path):
    return path[len("file://"):] if path.startswith("file://") else path


def _csv_lines(chunk):
    _, imgs, lbls = chunk
    for img, lbl in zip(imgs, lbls):
        yield str(int(lbl)) + "," + ",".join(map(str, img.tolist()))


def to_csv(sc, images, labels, out_dir, num_partitions, overwrite=True):
    """Write 'label,p0,...,p783' lines (raw pixels 0..255) as a Spark text data set
    (one part-NNNNN file per partition) under out_dir.  Returns the record count."""
    import shutil

    from ember import hdfs

    if hdfs.is_hdfs(out_dir):  # Spark writes it; Ember's client clears it first
        if hdfs.exists(out_dir):
            if not overwrite:
                raise FileExistsError(f"{out_dir} exists")
            hdfs.delete(out_dir, recursive=True)
    else:
        local = _local_path(out_dir)
        if os.path.exists(local):
            if not overwrite:
                raise FileExistsError(f"{out_dir} exists")
            shutil.rmtree(local)
    chunks = _chunks(images, labels, num_partitions)
    sc.parallelize(chunks, len(chunks)).flatMap(_csv_lines).saveAsTextFile(out_dir)
    return int(sum(c[2].shape[0] for c in chunks))


def _expand_chunks(scaled, batches):
    """mapInArrow: rows (images bytes, labels bytes, first id) of whole chunks ->
    one row per record: id, pixels array<float> ([0,1] if scaled, else 0..255), label."""
    import pyarrow as pa

    for b in batches:
        for imgs, lbls, first in zip(b.column(0).to_pylist(), b.column(1).to_pylist(),
                                     b.column(2).to_pylist()):
            x = np.frombuffer(imgs, dtype=np.uint8).astype(np.float32)
            if scaled:
                x /= 255.0
            y = np.frombuffer(lbls, dtype=np.int64)
            offsets = pa.array(np.arange(0, x.size + 1, NUM_PIXELS, dtype=np.int32))
            yield pa.RecordBatch.from_arrays(
                [pa.array(np.arange(first, first + y.size, dtype=np.int64)),
                 pa.ListArray.from_arrays(offsets, pa.array(x)), pa.array(y)],
                names=["id", "pixels", "label"])


def to_dataframe(spark, images, labels, num_partitions, scaled=True):
    """The records as a DataFrame, one contiguous chunk per partition (equal
    partitions): id long (the record's index), image array<float> in [0,1]
    and label long; with scaled=False the raw 0..255 values, named pixels."""
    import functools

    from ember.connect import is_connect

    chunks = _chunks(images, labels, num_partitions)
    rows = [(imgs.tobytes(), lbls.tobytes(), first) for first, imgs, lbls in chunks]
    schema = "images binary, labels binary, first long"
    if is_connect(spark):  # no SparkContext: the client's rows, one per partition
        blobs = spark.createDataFrame(rows, schema).repartition(len(rows))
    else:
        blobs = spark.createDataFrame(spark.sparkContext.parallelize(rows, len(rows)), schema)
    df = blobs.mapInArrow(
        functools.partial(_expand_chunks, scaled), "id long, pixels array<float>, label long")
    return df.withColumnRenamed("pixels", "image") if scaled else df


def to_tfrecords(spark, images, labels, out_dir, num_partitions, overwrite=True):
    """Write one TFRecord file per partition, out_dir/part-NNNNN.tfrecord, of
    tf.train.Example {'image': float_list[784] in [0,1], 'label': int64_list[1]},
    with Ember's C writer (ember.tfrecord.save: each file appears atomically).

    out_dir must be a path every executor can write (local mode, or a shared
    file system).  Returns the total record count."""
    from ember import tfrecord

    df = to_dataframe(spark, images, labels, num_partitions).select("image", "label")
    return tfrecord.save(df, _local_path(out_dir), mode="overwrite" if overwrite else "error")


def tfrecord_files(data_dir, split):
    """Sorted TFRecord files of a split written by to_tfrecords under
    data_dir/tfrecords/{train,test} (data_dir local or hdfs://)."""
    from ember import hdfs

    d = os.path.join(data_dir, "tfrecords", split)
    if hdfs.is_hdfs(d):
        if not hdfs.exists(d):
            return []
        return sorted(hdfs.join(d, n) for n in hdfs.listdir(d) if n.endswith(".tfrecord"))
    if not os.path.isdir(d):
        return []
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".tfrecord"))
