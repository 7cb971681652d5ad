import threading

from hypothesis import given, strategies as st

from storage.ids import PREFIXES, is_valid_id, new_id, sql_check


def test_ids_have_the_prefix_and_fourteen_base36_chars():
    for prefix in PREFIXES:
        value = new_id(prefix)
        head, body = value.split("_")
        assert head == prefix and len(body) == 14 and body.isalnum() and body == body.lower()
        assert is_valid_id(value, prefix) and is_valid_id(value)


def test_ids_are_strictly_increasing_and_unique_within_a_process():
    values = [new_id("msg") for _ in range(50_000)]
    assert values == sorted(values)
    assert len(set(values)) == len(values)


def test_ids_are_unique_across_threads():
    results: list[list[str]] = [[] for _ in range(4)]

    def make(slot: list[str]) -> None:
        slot.extend(new_id("scp") for _ in range(10_000))

    threads = [threading.Thread(target=make, args=(slot,)) for slot in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    everything = [v for slot in results for v in slot]
    assert len(set(everything)) == len(everything)


def test_unknown_prefix_is_refused():
    try:
        new_id("zzz")
    except ValueError:
        return
    raise AssertionError("unknown prefix accepted")


@given(st.one_of(st.text(max_size=30), st.integers(), st.none(), st.binary(max_size=20)))
def test_validation_rejects_arbitrary_values(value):
    if is_valid_id(value):
        assert isinstance(value, str) and value[:3] in PREFIXES and len(value) == 18


def test_validation_rejects_near_misses():
    good = new_id("wsp")
    for bad in (good.upper(), good + "0", good[:-1], good.replace("_", "-"), "xyz_" + good[4:], good[:5] + "!" + good[6:]):
        assert not is_valid_id(bad)
    assert not is_valid_id(good, "mem")
    assert "wsp_" in sql_check("id", "wsp")
