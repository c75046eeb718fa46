"""The tile-skipping description (key_range, sink_end) must agree with the dense visibility matrix."""
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from npattn.core.masks import Visibility

bounds = st.none() | st.integers(0, 12)
windows = st.none() | st.integers(0, 12) | st.tuples(bounds, bounds)


@given(causal=st.booleans(), window=windows, sinks=st.integers(0, 5),
       q_len=st.integers(0, 12), kv_len=st.integers(0, 12), q_offset=st.none() | st.integers(-15, 15))
def test_key_range_and_sinks_describe_the_matrix(causal, window, sinks, q_len, kv_len, q_offset):
    """Also for rows a q_offset puts before the first key or past the last: the band stays
    inside [0, kv_len], which the kernels' tile loops rely on."""
    visibility = Visibility.from_options(causal, window, sinks, q_offset)
    matrix = visibility.matrix(np, q_len, kv_len)
    for row in range(q_len):
        lo, hi = visibility.key_range(row, q_len, kv_len)
        expected = np.zeros(kv_len, bool)
        expected[lo:hi] = True
        expected[:visibility.sink_end(row, q_len, kv_len)] = True
        np.testing.assert_array_equal(matrix[row], expected, err_msg=f"row {row} of {visibility}")
        assert 0 <= lo <= hi <= kv_len


def test_int_window_is_symmetric_or_left_only_when_causal():
    assert Visibility.from_options(False, 3, 0) == Visibility(False, 3, 3, 0)
    assert Visibility.from_options(True, 3, 0) == Visibility(True, 3, 0, 0)
    assert Visibility.from_options(True, (None, None), 2).is_full is False
    assert Visibility.from_options(False, (None, None), 2).is_full
