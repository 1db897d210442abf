"""The main job's own logic that needs no Spark (examples/fashion_mnist/main.py)."""

from __future__ import annotations

import json
import os

import pytest

from examples.fashion_mnist import main as job


class _NoSpark:
    """Any use of Spark fails: the data must have been reused."""

    def __getattr__(self, name: str) -> None:
        raise AssertionError(f"setup_data used Spark ({name}) where it should reuse the data")


def _args(tmp_path, *extra: str):
    args = job.parse_args(["--data-dir", str(tmp_path / "data"), "--partitions", "4",
                           "--train-limit", "600", *extra])
    os.makedirs(args.data_dir, exist_ok=True)
    return args


def _write_manifest(args, **changes) -> str:
    path = os.path.join(args.data_dir, job.DATA_MANIFEST)
    written = dict(train_limit=600, test_limit=0, partitions=4, csv=True, sizes=[600, 10000])
    written.update(changes)
    with open(path, "w") as f:
        json.dump(written, f)
    return path


def test_setup_data_reuses_what_an_earlier_run_wrote(tmp_path) -> None:
    args = _args(tmp_path)
    _write_manifest(args)
    assert job.setup_data(_NoSpark(), args) == (600, 10000)
    # a Connect client needs the TFRecords only: a classic run's data serves it
    remote = _args(tmp_path, "--remote", "sc://nowhere:15002")
    assert job.setup_data(_NoSpark(), remote) == (600, 10000)


@pytest.mark.parametrize("changes", [
    {"partitions": 8},              # other partitions
    {"train_limit": 0},             # other limits
    {"csv": False},                 # a Connect client's data: no CSV for a classic run
])
def test_setup_data_writes_again_when_the_data_differs(tmp_path, changes) -> None:
    args = _args(tmp_path)
    manifest = _write_manifest(args, **changes)
    with pytest.raises(AssertionError, match="setup_data used Spark"):
        job.setup_data(_NoSpark(), args)
    # the old manifest is gone before anything is written: an interrupted
    # rewrite is never taken for complete data
    assert not os.path.exists(manifest)


def _csv_lines(n: int):
    from examples.fashion_mnist import data

    images, labels = data.load_split("test")
    return [",".join([str(int(labels[i]))] + [str(int(v)) for v in images[i].reshape(-1)])
            for i in range(n)]


def test_csv_partition_parses_as_line_by_line_across_chunks() -> None:
    import numpy as np

    from examples.fashion_mnist import data

    lines = _csv_lines(data.CSV_CHUNK_LINES + 3)
    lines[-1] += "\r"  # a line ending left on by a reader
    records = list(data.parse_csv_partition(iter(lines)))
    assert len(records) == len(lines)
    for i in (0, data.CSV_CHUNK_LINES - 1, data.CSV_CHUNK_LINES, len(lines) - 1):
        image, label = data.parse_csv_line(lines[i])
        assert records[i][0].dtype == np.float32 and np.array_equal(records[i][0], image)
        assert type(records[i][1]) is int and records[i][1] == label
    assert list(data.parse_csv_partition(iter([]))) == []


@pytest.mark.parametrize("bad, error", [
    ("1,2,3", "3 fields, expected 785"),
    ("x", "bad Fashion-MNIST CSV line 'x,0,0"),
    ("11", "label 11.0 not in 0..9"),
    ("1.5", "label 1.5 not in 0..9"),
])
def test_csv_partition_names_the_bad_line_as_line_by_line(bad: str, error: str) -> None:
    from examples.fashion_mnist import data

    good = _csv_lines(3)
    line = bad if "," in bad else bad + good[0][1:]  # a bad field count, or a bad label
    with pytest.raises(ValueError, match="bad Fashion-MNIST CSV line") as raised:
        list(data.parse_csv_partition(iter(good + [line] + good)))
    assert error in str(raised.value)
    with pytest.raises(ValueError) as line_by_line:
        data.parse_csv_line(line)
    assert str(line_by_line.value) == str(raised.value)
