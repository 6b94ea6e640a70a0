import pytest

from lineage.core.errors import TidemarkError
from lineage.core.partitions import block_key, parse_block_key, partitions_name


def test_keys_round_trip_and_sort_in_block_order():
    keys = [block_key("fact.orders", s, qualified=False) for s in (1, 2, 10, 123)]
    assert keys == ["00000001", "00000002", "00000010", "00000123"] == sorted(keys)
    assert parse_block_key("00000123") == (None, 123)
    q = block_key("fact.orders#web:1", 7, qualified=True)
    assert q == "fact.orders#web:1@00000007" and parse_block_key(q) == ("fact.orders#web:1", 7)
    assert parse_block_key(block_key("t.x", 123_456_789, qualified=False)) == (None, 123_456_789)


@pytest.mark.parametrize("bad", ["", "12", "abc", "x@", "x@12", "00000001x"])
def test_bad_keys_are_rejected_with_the_expected_form(bad):
    with pytest.raises(TidemarkError, match="not a block partition key"):
        parse_block_key(bad)


def test_seq_starts_at_one_and_names_are_per_table():
    with pytest.raises(TidemarkError, match="start at 1"):
        block_key("t.x", 0, qualified=False)
    assert partitions_name("fact.order_items") == "tidemark_blocks__fact__order_items"


def test_retention_keeps_the_newest_blocks_of_each_topic():
    from lineage.core.partitions import expired_block_keys

    keys = [block_key("t.x", s, qualified=False) for s in (3, 1, 2, 5, 4)] + ["manual-key"]
    assert expired_block_keys(keys, 2) == ["00000001", "00000002", "00000003"]
    assert expired_block_keys(keys, 10) == []
    q = [block_key("t.x#a", 1, qualified=True), block_key("t.x#a", 2, qualified=True), block_key("t.x#b", 1, qualified=True)]
    assert expired_block_keys(q, 1) == ["t.x#a@00000001"]
    with pytest.raises(TidemarkError, match="at least 1"):
        expired_block_keys(keys, 0)
