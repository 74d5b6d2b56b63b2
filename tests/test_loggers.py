"""The default CSV logger keeps metrics.csv intact if a crash hits a header rewrite."""

from __future__ import annotations

import csv

import pytest

from salvage.loggers import SafeCSVLogger


def test_new_metric_names_rewrite_the_header_and_keep_rows(tmp_path):
    lg = SafeCSVLogger(tmp_path, name="", flush_logs_every_n_steps=1)
    lg.log_metrics({"loss/policy": 0.5}, step=0)
    lg.save()
    lg.log_metrics({"loss/policy": 0.4, "relay/retained": 1.0}, step=1)
    lg.save()
    rows = list(csv.DictReader(open(lg.experiment.metrics_file_path)))
    assert [r["loss/policy"] for r in rows] == ["0.5", "0.4"] and rows[1]["relay/retained"] == "1.0"


def test_a_crash_during_the_rewrite_leaves_the_previous_file(tmp_path, monkeypatch):
    lg = SafeCSVLogger(tmp_path, name="", flush_logs_every_n_steps=1)
    lg.log_metrics({"a": 1.0}, step=0)
    lg.save()
    path = lg.experiment.metrics_file_path
    before = open(path).read()

    def boom(self, rows):
        raise OSError("disk gone mid-write")

    monkeypatch.setattr(csv.DictWriter, "writerows", boom)
    with pytest.raises(OSError, match="mid-write"):  # a new key: the header is rewritten
        lg.log_metrics({"a": 2.0, "b": 3.0}, step=1)
        lg.save()
    assert open(path).read() == before
    assert not [p for p in tmp_path.rglob(".metrics.csv.*")]  # no temporary left behind
