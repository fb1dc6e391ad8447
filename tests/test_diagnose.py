"""The communication check: ``cadence diagnose comm`` across two gloo processes, and its arithmetic."""

from __future__ import annotations

import pytest

from strategies.diagnose import (
    CommunicationReport, SizeResult, bus_bandwidth, check_communication, format_size, parse_size,
)
from trainer.cli import main


def test_diagnose_comm_verifies_all_reduce_and_prints_latency_and_bandwidth_per_size(capsys):
    assert main(["diagnose", "comm", "--devices", "2", "--sizes", "4K,256K", "--iterations", "3"]) == 0
    printed = capsys.readouterr().out
    assert "all_reduce over 2 ranks (gloo, cpu)" in printed
    assert "4 KiB" in printed and "256 KiB" in printed
    assert printed.count("  ok") == 2
    assert "OK: 2 ranks on 1 machine(s) agree on every all_reduce" in printed


def test_a_wrong_result_on_any_rank_fails_the_verdict():
    report = CommunicationReport(2, "nccl", "cuda:0", ["a", "b"],
                                 [SizeResult(1024, 1e-5, 1e8, []), SizeResult(2**20, 1e-3, 1e9, [1])])
    assert not report.ok
    assert report.verdict.startswith("FAIL: all_reduce returned wrong numbers on rank(s) [1] at 1 MiB")
    assert "WRONG on ranks [1]" in str(report)


def test_bus_bandwidth_follows_nccl_tests():
    # 1 GB in one second over 4 ranks: each link carries 2 * 3/4 of the data.
    assert bus_bandwidth(10**9, 1.0, 4) == pytest.approx(1.5e9)
    assert bus_bandwidth(10**9, 1.0, 1) == 0.0


def test_sizes_read_with_units():
    assert [parse_size(text) for text in ("4096", "64K", "16MiB", "1g")] == [4096, 65536, 16 * 2**20, 2**30]
    assert format_size(65536) == "64 KiB" and format_size(1000) == "1000 B"


@pytest.mark.parametrize("text", ["", "-4K", "12Q", "K"])
def test_a_size_that_is_not_a_size_is_an_error(text):
    with pytest.raises(ValueError, match="use a positive number of bytes with an optional unit"):
        parse_size(text)


def test_bad_sizes_or_iterations_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"check_communication\(sizes=\(0,\)\): use positive sizes in bytes"):
        check_communication(devices=2, sizes=(0,))
    with pytest.raises(ValueError, match=r"check_communication\(iterations=0\): use an int >= 1 or None"):
        check_communication(devices=2, iterations=0)


def test_a_devices_value_that_is_not_a_number_is_a_usage_error():
    with pytest.raises(SystemExit, match='--devices two: use a number of processes or "auto"'):
        main(["diagnose", "comm", "--devices", "two"])
