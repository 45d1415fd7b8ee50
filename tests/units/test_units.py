"""radixserve.units: one reading of k/M/G (decimal) and Ki/Mi/Gi (binary) for every flag."""

import pytest

from radixserve.cli import build_parser_for
from radixserve.units import SizeError, parse_bytes, parse_tokens


def parse(argv: list[str]):
    return build_parser_for(argv).parse_args(argv)


def test_token_counts():
    assert parse_tokens("8192") == 8192
    assert parse_tokens("500k") == 500_000
    assert parse_tokens("4M") == parse_tokens("4m") == 4_000_000
    assert parse_tokens("1.5M") == 1_500_000
    assert parse_tokens("2G") == 2_000_000_000
    assert parse_tokens("32Ki") == 32_768
    assert parse_tokens("1Mi") == 1 << 20
    for bad in ("", "M", "-5", "1e6", "4MB", "1.5", "0.5k5", "4 MiB", "12X"):
        with pytest.raises(SizeError):
            parse_tokens(bad)


def test_byte_sizes():
    assert parse_bytes("1073741824") == 1 << 30
    assert parse_bytes("8GiB") == parse_bytes("8Gi") == 8 << 30
    assert parse_bytes("24GB") == parse_bytes("24G") == 24 * 10**9
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("500mb") == 500 * 10**6
    assert parse_bytes("1.5KiB") == 1536
    assert parse_bytes("100B") == 100
    for bad in ("", "GiB", "-1GB", "lots", "8GiBs"):
        with pytest.raises(ValueError, match="not a memory size"):
            parse_bytes(bad)


def test_every_size_flag_reads_4M_alike():
    """serve, plan and replay agree: `4M` tokens is 4,000,000 and `4MiB` bytes 4 x 2^20."""
    serve = parse(["serve", "--kv-host-tokens", "4M", "--kv-cache-tokens", "4M",
                               "--max-pinned-tokens", "4M", "--kv-host-bytes", "4MiB",
                               "--kv-disk-bytes", "4MiB", "--max-body-bytes", "4MiB"])
    assert serve.kv_host_tokens == serve.kv_cache_tokens == serve.max_pinned_tokens == 4_000_000
    assert serve.kv_host_bytes == serve.kv_disk_bytes == serve.max_body_bytes == 4 << 20
    plan = parse(["plan", "m", "--context", "4M", "--shared-prefix-tokens", "4M",
                              "--kv-cache-tokens", "4M", "--memory", "4MiB"])
    assert plan.context == plan.shared_prefix_tokens == plan.kv_cache_tokens == 4_000_000
    assert plan.memory == 4 << 20
    from radixserve.replay.report import parse_capacity
    assert parse_capacity("4M") == 4_000_000
    replay = parse(["replay", "t.jsonl", "--kv-bytes-per-token", "128KiB"])
    assert replay.kv_bytes_per_token == 131_072


def test_argparse_prints_the_message(capsys):
    with pytest.raises(SystemExit):
        parse(["serve", "--kv-host-tokens", "4MB"])
    assert "not a token count: '4MB'" in capsys.readouterr().err
