"""Every module, layer, cache and optimizer checks its arguments before it allocates
anything, and module calls check their inputs' rank and features: each error names the
class, the argument, what it must be and what it got."""
import re

import numpy as np
import pytest

from npattn import nn
from npattn.nn import optim
from npattn.autograd import Tensor

PARAMETERS = [Tensor(np.zeros(2, np.float32), requires_grad=True)]

BAD_ARGUMENTS = [
    (lambda: nn.KVCache(1, 2, 4, capacity=-1), ValueError, "KVCache: capacity must be an int >= 1; got -1"),
    (lambda: nn.KVCache(1, 2, 4, 8, dtype="int8"), TypeError,
     "KVCache: dtype must be one of float16, bfloat16, float32, float64; got int8"),
    (lambda: nn.KVCache(1, 2.0, 4, 8), TypeError, "KVCache: num_kv_heads must be an int >= 1; got float 2.0"),
    (lambda: nn.KVCache(1, 2, 4, 8, window=-1), ValueError, "KVCache: window must be an int >= 0; got -1"),
    (lambda: nn.MultiHeadAttention(64, 0), ValueError, "MultiHeadAttention: num_heads must be an int >= 1; got 0"),
    (lambda: nn.MultiHeadAttention(64, 8, dtype="int32"), TypeError, "MultiHeadAttention: dtype must be one of"),
    (lambda: nn.MultiHeadAttention(64, 8, dropout=1.0), ValueError,
     "MultiHeadAttention: dropout must be in [0, 1); got 1.0"),
    (lambda: nn.MultiHeadAttention(64, 8, sinks=-1), ValueError, "MultiHeadAttention: sinks must be an int >= 0"),
    (lambda: nn.MultiHeadAttention(64, 8, kdim=0), ValueError, "MultiHeadAttention: kdim must be an int >= 1"),
    (lambda: nn.GroupedQueryAttention(64, 8, 3), ValueError,
     "GroupedQueryAttention: num_groups must divide num_heads (8); got 3"),
    (lambda: nn.GroupedQueryAttention(64, 8, 0), ValueError, "GroupedQueryAttention: num_groups must be an int >= 1"),
    (lambda: nn.SlidingWindowAttention(64, 8, 0), ValueError, "SlidingWindowAttention: window_size must be an int >= 1"),
    (lambda: nn.DisentangledAttention(64, 8, max_relative_positions=4, position_buckets=-1), ValueError,
     "DisentangledAttention: position_buckets must be an int >= 0; got -1"),
    (lambda: nn.Linear(0, 3), ValueError, "Linear: in_features must be an int >= 1; got 0"),
    (lambda: nn.Embedding(3, True), TypeError, "Embedding: embedding_dim must be an int >= 1; got bool True"),
    (lambda: nn.LayerNorm(4, eps=0.0), ValueError, "LayerNorm: eps must be positive and finite; got 0.0"),
    (lambda: nn.RMSNorm(4, eps=float("nan")), ValueError, "RMSNorm: eps must be positive and finite; got nan"),
    (lambda: nn.Dropout(p=-0.1), ValueError, "Dropout: p must be in [0, 1); got -0.1"),
    (lambda: nn.MLP(4, 0), ValueError, "MLP: hidden_dim must be an int >= 1; got 0"),
    (lambda: nn.TransformerEncoderLayer(64, 8, dim_feedforward=0), ValueError, "MLP: hidden_dim must be an int >= 1"),
    (lambda: optim.SGD(PARAMETERS, lr=float("nan")), ValueError, "SGD: lr must be positive and finite; got nan"),
    (lambda: optim.SGD(PARAMETERS, lr=0.1, momentum=-0.5), ValueError, "SGD: momentum must be in [0, 1]; got -0.5"),
    (lambda: optim.Adam(PARAMETERS, betas=(1.0, 0.9)), ValueError, "Adam: betas[0] must be in [0, 1); got 1.0"),
    (lambda: optim.Adam(PARAMETERS, betas=0.9), TypeError, "Adam: betas must be a pair (beta1, beta2); got 0.9"),
    (lambda: optim.AdamW(PARAMETERS, eps=-1e-8), ValueError, "AdamW: eps must be positive and finite; got -1e-08"),
    (lambda: optim.AdamW(PARAMETERS, weight_decay="0.1"), TypeError, "AdamW: weight_decay must be a real number"),
    (lambda: optim.clip_grad_norm(PARAMETERS, float("inf")), ValueError,
     "clip_grad_norm: max_norm must be positive and finite; got inf"),
]


@pytest.mark.parametrize("make, error, message", BAD_ARGUMENTS,
                         ids=[message.split(";")[0][:60] for _, _, message in BAD_ARGUMENTS])
def test_a_bad_argument_is_named(make, error, message):
    with pytest.raises(error, match=re.escape(message)):
        make()


def test_a_module_call_checks_its_inputs_rank_and_features():
    attention = nn.MultiHeadAttention(64, 8, kdim=32, seed=0)
    x = np.zeros((2, 10, 64), np.float32)
    with pytest.raises(ValueError, match=re.escape("MultiHeadAttention: query must be (B, S, embed_dim) with 64 "
                                                   "features last; got shape (10, 64)")):
        attention(x[0])
    with pytest.raises(ValueError, match=re.escape("MultiHeadAttention: key must be (B, S, kdim) with 32 features "
                                                   "last; got shape (2, 10, 64)")):
        attention(x, x, np.zeros((2, 10, 64), np.float32))
    out = attention(x, np.zeros((2, 5, 32), np.float32), np.zeros((2, 5, 64), np.float32))
    assert out.shape == (2, 10, 64)
